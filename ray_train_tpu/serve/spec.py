"""What one serving replica owns: a whole TPU slice, one vLLM worker per device.
Pure validation, no Ray, no vLLM.

A replica's vLLM engine runs ``tensor_parallel_size * pipeline_parallel_size``
workers, one per device of the slice, each in its own placement-group bundle
(``{"TPU": 1}``). The product must be the slice's device count, so that every
replica reserves exactly one whole slice and never a part of one, and both
sizes must fit the model (vLLM's rules): the attention heads divide by TP, the
KV heads divide by TP or TP by them, and there are at least PP layers. All of
it is checked here, before anything starts.

Example:
    >>> shape = ModelShape(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    >>> spec = SliceServeSpec(accelerator_type="v4", topology="2x2x2", model=shape)
    >>> spec.accelerator_type, spec.topology, spec.tensor_parallel_size, spec.pipeline_parallel_size
    ('TPU-V4', '2x2x2', 1, 8)
    >>> SliceServeSpec(accelerator_type="v4", topology="2x2x2").bundles()[0]
    {'TPU': 1}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from ray_train_tpu.topology import GENERATIONS, Topology, get_generation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The parts of a model's config that bound its parallelism."""

    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    source: str = "model"
    # The model's memory needs (a `layout_planner.ModelFootprint`), when its
    # config says enough to count them: a layout that cannot hold them is refused.
    footprint: Optional[Any] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for field in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers"):
            value = getattr(self, field)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{self.source}: config field {field} = {value!r} must be an integer >= 1")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "model") -> "ModelShape":
        """From a Hugging Face ``config.json`` dict (a multimodal model's
        ``text_config`` if it has one)."""
        cfg = config.get("text_config") or config
        missing = [k for k in ("num_attention_heads", "num_hidden_layers") if k not in cfg]
        if missing:
            raise ValueError(
                f"{source}: config.json has no {', '.join(missing)}; serving sizes tensor and "
                "pipeline parallelism from them (a decoder-only causal LM config has both)"
            )
        heads = cfg["num_attention_heads"]
        return cls(
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            num_hidden_layers=cfg["num_hidden_layers"],
            source=source,
        )

    def tp_problem(self, tp: int) -> Optional[str]:
        """Why `tp` cannot shard this model (vLLM's rules), or None."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % tp:
            return f"its {heads} attention heads do not divide by {tp}"
        if (kv % tp) if kv >= tp else (tp % kv):
            return f"its {kv} KV heads neither divide by {tp} nor divide {tp}"
        return None

    def pp_problem(self, pp: int) -> Optional[str]:
        if pp > self.num_hidden_layers:
            return f"it has {self.num_hidden_layers} layers, fewer than {pp} pipeline stages"
        return None


def size_parallelism(
    num_devices: int,
    model: Optional[ModelShape] = None,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    where: str = "the slice",
) -> tuple[int, int]:
    """(TP, PP) with ``TP * PP == num_devices`` that fit `model`.

    Unset sizes are chosen: the largest TP that fits, then PP = the rest.
    Raises ValueError naming the field, value, rule and a fix.
    """
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{name} {value!r} must be an integer >= 1 (or left out to be sized to the slice)")
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp is not None and pp is not None and tp * pp != num_devices:
        raise ValueError(
            f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} does not fill "
            f"{where}'s {num_devices} devices: a replica owns the whole slice, one vLLM worker per "
            f"device; choose TP x PP = {num_devices} or leave one of them out"
        )
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if value is not None and num_devices % value:
            raise ValueError(
                f"{name} {value} does not divide {where}'s {num_devices} devices "
                f"(rule: TP x PP = {num_devices}); valid: {', '.join(map(str, _divisors(num_devices)))}"
            )
    if tp is None and pp is not None:
        tp = num_devices // pp
    candidates = [tp] if tp is not None else sorted(_divisors(num_devices), reverse=True)
    problems = []
    for t in candidates:
        p = num_devices // t
        why = model and (model.tp_problem(t) or model.pp_problem(p))
        if not why:
            return t, p
        problems.append(f"TP={t} x PP={p}: {why}")
    fix = ("leave tensor_parallel_size and pipeline_parallel_size out to have them sized"
           if tensor_parallel_size or pipeline_parallel_size else "serve it on a slice whose device count fits")
    raise ValueError(
        f"{model.source} cannot be spread over {where}'s {num_devices} devices: "
        + "; ".join(problems) + f"; {fix}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceServeSpec:
    """A replica's slice and how the model is spread over it, checked before
    anything starts.

    Args:
        accelerator_type: ``"TPU-V6E"`` etc. (aliases such as ``"v6e"`` accepted).
        topology: the slice, e.g. ``"4x4"``.
        tensor_parallel_size, pipeline_parallel_size: default (None): sized so
            that TP x PP is the slice's device count, TP as large as the model
            allows.
        model: the model's shape; without it, sizes are checked against the
            slice only.
    """

    accelerator_type: str
    topology: str
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    model: Optional[ModelShape] = None

    def __post_init__(self):
        try:
            gen = get_generation(self.accelerator_type)
        except (TypeError, ValueError):
            raise ValueError(
                f"accelerator_type {self.accelerator_type!r} is not a TPU generation; "
                f"ray_train_tpu.serve serves on TPU slices only; valid: {', '.join(GENERATIONS)} "
                "(use Ray Serve LLM's LLMConfig directly for GPUs)"
            ) from None
        topo = Topology.parse(self.topology, gen.accelerator_type)
        object.__setattr__(self, "accelerator_type", topo.accelerator_type)
        object.__setattr__(self, "topology", topo.name)
        tp, pp = size_parallelism(
            topo.num_devices, self.model, self.tensor_parallel_size, self.pipeline_parallel_size,
            where=f"one {topo}",
        )
        object.__setattr__(self, "tensor_parallel_size", tp)
        object.__setattr__(self, "pipeline_parallel_size", pp)
        footprint = self.model and self.model.footprint
        why = footprint and footprint.memory_problem(gen, tp, pp)
        if why:
            raise ValueError(
                f"{self.model.source} does not fit one {topo} as tensor_parallel_size {tp} x "
                f"pipeline_parallel_size {pp}: {why} (rule: weights + one full-context sequence of KV cache "
                f"within 90% of each device's HBM); use a larger slice: python -m ray_train_tpu serve --model "
                f"{self.model.source} --topology <larger> --accelerator-type {topo.accelerator_type} --plan"
            )

    @property
    def parsed(self) -> Topology:
        return Topology.parse(self.topology, self.accelerator_type)

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per device: vLLM's Ray executor puts one worker in each."""
        return [{"TPU": 1} for _ in range(self.parsed.num_devices)]

    @classmethod
    def from_llm_config(cls, llm_config: Any, model: Optional[ModelShape] = None) -> "SliceServeSpec":
        """The spec of an ``LLMConfig``: ``accelerator_type``,
        ``accelerator_config.topology`` and ``engine_kwargs``."""
        accel_cfg = getattr(llm_config, "accelerator_config", None)
        if getattr(accel_cfg, "kind", None) != "tpu" or not getattr(accel_cfg, "topology", None):
            raise ValueError(
                f"LLMConfig.accelerator_config {accel_cfg!r} has no TPU topology; a replica owns "
                "a whole slice: accelerator_config={'kind': 'tpu', 'topology': '4x4'} "
                "(see ray_train_tpu.serve.build_llm_config)"
            )
        if llm_config.accelerator_type is None:
            raise ValueError(
                f"LLMConfig.accelerator_type is None; it must be a TPU generation, one of {', '.join(GENERATIONS)}"
            )
        kwargs: Mapping[str, Any] = llm_config.engine_kwargs or {}
        return cls(
            accelerator_type=str(getattr(llm_config.accelerator_type, "value", llm_config.accelerator_type)),
            topology=accel_cfg.topology,
            tensor_parallel_size=kwargs.get("tensor_parallel_size"),
            pipeline_parallel_size=kwargs.get("pipeline_parallel_size"),
            model=model,
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
