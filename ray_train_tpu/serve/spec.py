"""What one serving replica owns: a whole TPU slice. Pure validation, no Ray.

Ray Serve LLM sizes a replica's TPU reservation from the engine's
``tensor_parallel_size * pipeline_parallel_size`` (``TPUAccelerator.default_bundles``):
that product must be the slice's device count, so that every replica reserves
exactly one whole slice, one bundle per host, and never a part of one.

Example:
    >>> spec = SliceServeSpec(accelerator_type="v6e", topology="4x4")
    >>> spec.accelerator_type, spec.topology, spec.tensor_parallel_size
    ('TPU-V6E', '4x4', 16)
    >>> spec.bundles()[0]
    {'TPU': 4, 'accelerator_type:TPU-V6E': 0.001}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from ray_train_tpu.topology import GENERATIONS, Topology, get_generation


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceServeSpec:
    """A replica's slice, checked before anything starts.

    Args:
        accelerator_type: ``"TPU-V6E"`` etc. (aliases such as ``"v6e"`` accepted).
        topology: the slice, e.g. ``"4x4"``.
        tensor_parallel_size: default (None) is the slice's device count, the
            only value that reserves exactly one whole slice per replica.
        pipeline_parallel_size: must be 1.
    """

    accelerator_type: str
    topology: str
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        try:
            gen = get_generation(self.accelerator_type)
        except (TypeError, ValueError):
            raise ValueError(
                f"accelerator_type {self.accelerator_type!r} is not a TPU generation; "
                f"the TorchTPU engine serves on TPU slices only; valid: {', '.join(GENERATIONS)} "
                "(use Ray Serve LLM's vLLM engine for GPUs)"
            ) from None
        topo = Topology.parse(self.topology, gen.accelerator_type)
        object.__setattr__(self, "accelerator_type", topo.accelerator_type)
        object.__setattr__(self, "topology", topo.name)
        pp = self.pipeline_parallel_size
        if not _is_int(pp) or pp != 1:
            raise ValueError(
                f"pipeline_parallel_size {pp!r} is not supported by the TorchTPU engine "
                "(rule: 1, one replica per slice); remove it from engine_kwargs"
            )
        tp = self.tensor_parallel_size
        if tp is None:
            object.__setattr__(self, "tensor_parallel_size", topo.num_devices)
        elif not _is_int(tp) or tp != topo.num_devices:
            raise ValueError(
                f"tensor_parallel_size {tp!r} does not fit one {topo}: a replica owns the "
                f"whole slice, so it must equal the slice's {topo.num_devices} devices "
                f"({topo.num_hosts} host(s) x {topo.devices_per_host}); set "
                f"tensor_parallel_size={topo.num_devices} or leave it out"
            )

    @property
    def parsed(self) -> Topology:
        return Topology.parse(self.topology, self.accelerator_type)

    def bundles(self) -> list[dict[str, float]]:
        """The per-host bundles Ray Serve LLM asks for (one per host)."""
        topo = self.parsed
        return [
            {"TPU": topo.devices_per_host, f"accelerator_type:{topo.accelerator_type}": 0.001}
            for _ in range(topo.num_hosts)
        ]

    @classmethod
    def from_llm_config(cls, llm_config: Any) -> "SliceServeSpec":
        """The spec of an ``LLMConfig``: ``accelerator_type``,
        ``accelerator_config.topology`` and ``engine_kwargs``."""
        accel_cfg = getattr(llm_config, "accelerator_config", None)
        if getattr(accel_cfg, "kind", None) != "tpu" or not getattr(accel_cfg, "topology", None):
            raise ValueError(
                f"LLMConfig.accelerator_config {accel_cfg!r} has no TPU topology; the "
                "TorchTPU engine needs a whole slice: accelerator_config="
                "{'kind': 'tpu', 'topology': '4x4'} (see ray_train_tpu.serve.build_llm_config)"
            )
        if llm_config.accelerator_type is None:
            raise ValueError(
                "LLMConfig.accelerator_type is None; the TorchTPU engine needs a TPU "
                f"generation, one of {', '.join(GENERATIONS)}"
            )
        kwargs: Mapping[str, Any] = llm_config.engine_kwargs or {}
        return cls(
            accelerator_type=str(getattr(llm_config.accelerator_type, "value", llm_config.accelerator_type)),
            topology=accel_cfg.topology,
            tensor_parallel_size=kwargs.get("tensor_parallel_size"),
            pipeline_parallel_size=kwargs.get("pipeline_parallel_size", 1),
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
