"""`TPUTorchConfig`: the Ray Train backend config that sets up torch.distributed on TPU slices.

Its backend (`ray_train_tpu._backend`) runs in Ray Train's controller: it ranks
the workers by slice, host and chip, gives each its TorchTPU environment
(`ray_train_tpu.launch_env`) and builds the process group (``tpu_dist`` on TPUs,
gloo on an explicitly simulated slice, Ray's own backend on GPUs).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Union

from ray.train.torch import TorchConfig

from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu._backend import _TPUTorchBackend
from ray_train_tpu.hang import DEFAULT_HANG_TIMEOUT_S
from ray_train_tpu.topology import MAX_DEVICES_PER_HOST, Topology

BACKENDS = ("auto", "tpu_dist", "gloo", "nccl")

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TPUTorchConfig(TorchConfig):
    """torch.distributed on TPU slices, for `TPUTorchTrainer` or Ray's `TorchTrainer`.

    Args:
        backend: ``"auto"`` (default) picks ``tpu_dist`` on TPUs, ``gloo`` in
            explicit simulation, ``nccl`` on GPUs. Set it only to override that.
        timeout_s: timeout of collective operations, as in `TorchConfig`.
        rendezvous_timeout_s: how long every worker may take to join the process
            group before the attempt fails, naming the ranks and hosts missing.
        topology, accelerator_type: the slice; by default read from the hosts'
            ``TPU_TOPOLOGY`` / ``TPU_ACCELERATOR_TYPE`` (GKE sets both), and
            checked against them when given.
        base_port: first slice-builder port on every host (``TORCH_TPU_BASE_PORT``).
        master_port: rendezvous port on the first host; default 29500 on TPUs (as
            torch_tpu's launcher) and a free port in simulation.
        megascale_port: MegaScale coordinator port for multi-slice jobs.
        extra_env: more variables for every worker; they also override computed
            ones (with a warning naming each), except ranks, which Ray fixes.
        num_slices: slices in the job; by default the number of slice names the
            workers report, and checked against them when given. ``(min, max)``
            for an elastic job: each attempt runs on the live slices, and their
            count must lie in the range.
        hang_timeout_s: a collective that some ranks never join fails the attempt
            after this many seconds without progress on any rank, naming the
            missing ranks and hosts (`ray_train_tpu.hang`); Ray Train retries it
            from the last checkpoint. ``None`` turns the watch off. It must exceed
            the longest time one rank works alone (a compile, a save).
        strategy: the parallelism strategy that ``prepare_model`` applies (set by
            `TPUTorchTrainer`); ``None`` means DDP.

    Example:
        >>> from ray.train.torch import TorchTrainer
        >>> from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
        >>> trainer = TorchTrainer(  # doctest: +SKIP
        ...     train_fn,
        ...     scaling_config=TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E"),
        ...     torch_config=TPUTorchConfig(rendezvous_timeout_s=120),
        ... )
    """

    backend: Optional[str] = "auto"
    rendezvous_timeout_s: float = 120.0
    topology: Optional[str] = None
    accelerator_type: Optional[str] = None
    base_port: int = C.DEFAULT_TORCH_TPU_BASE_PORT
    master_port: Optional[int] = None
    megascale_port: int = C.DEFAULT_MEGASCALE_PORT
    extra_env: dict = dataclasses.field(default_factory=dict)
    num_slices: Union[None, int, tuple] = None
    strategy: Any = None
    hang_timeout_s: Optional[float] = DEFAULT_HANG_TIMEOUT_S

    def __post_init__(self):
        if self.backend is None:
            # Ray's TorchTrainer replaces a None backend with "tpu_dist"; "auto"
            # keeps the choice ours (tpu_dist, gloo in simulation, nccl on GPUs).
            self.backend = "auto"
        if self.init_method != "env":
            raise ValueError(
                f"TPUTorchConfig(init_method={self.init_method!r}) is not supported: "
                "TorchTPU rendezvous uses environment variables; use 'env'"
            )
        V.check_choice("TPUTorchConfig", "backend", self.backend, BACKENDS,
                       fix="leave backend='auto' (tpu_dist on TPUs, gloo in simulation, nccl on GPUs)")
        for field in ("timeout_s", "rendezvous_timeout_s"):
            V.check_seconds("TPUTorchConfig", field, getattr(self, field))
        # Slice-builder and MegaScale ports count up from the base, one per device of a host.
        V.check_port("TPUTorchConfig", "base_port", self.base_port, span=MAX_DEVICES_PER_HOST)
        V.check_port("TPUTorchConfig", "megascale_port", self.megascale_port,
                     span=C.MEGASCALE_PORTS_PER_DEVICE * MAX_DEVICES_PER_HOST)
        if self.master_port is not None:
            V.check_port("TPUTorchConfig", "master_port", self.master_port)
        self.extra_env = V.check_env("TPUTorchConfig", "extra_env", self.extra_env)
        if self.num_slices is not None:
            self.num_slices = V.check_num_slices_range("TPUTorchConfig", self.num_slices)
        if self.hang_timeout_s is not None:
            V.check_seconds("TPUTorchConfig", "hang_timeout_s", self.hang_timeout_s,
                            fix="e.g. hang_timeout_s=600, or None to turn hang detection off")
        if (self.topology is None) != (self.accelerator_type is None):
            raise ValueError(
                "TPUTorchConfig needs both topology and accelerator_type, or neither "
                f"(read from the hosts); got topology={self.topology!r}, "
                f"accelerator_type={self.accelerator_type!r}"
            )
        if self.topology is not None:
            Topology.parse(self.topology, self.accelerator_type)  # fail early

    @property
    def backend_cls(self):
        return _TPUTorchBackend

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["strategy"] = None if self.strategy is None else repr(self.strategy)
        out["extra_env"] = dict(self.extra_env)
        return out


