"""`FSDP2TPStrategy`: 2-D parallelism, tensor parallel inside a host and FSDP2 across.

First ``parallelize_module`` on the ``tp`` mesh dimension (consecutive ranks,
neighbouring chips of one host), then ``fully_shard`` on the data-parallel
dimensions (``dp_shard``, plus ``dp_replicate`` across slices), as torchtitan
applies them. Both meshes are slices of one ``DeviceMesh``, which FSDP2 needs
to shard DTensor parameters a second time.

Example:
    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    >>> s = FSDP2TPStrategy(tp_size=2, plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    >>> s.validate(None, num_slices=1, world_size=8).shape
    (1, 4, 2)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Optional

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ray_train_tpu.mesh import MeshLayout
from ray_train_tpu.strategies.base import dp_mesh, standard_layout, to_device
from ray_train_tpu.strategies.fsdp2 import FSDP2Strategy, apply_fsdp
from ray_train_tpu.strategies.tensor_parallel import ParallelizeFn, apply_tp, check_tp_plan, check_tp_size

if TYPE_CHECKING:
    import torch

    from ray_train_tpu.topology import Topology


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2TPStrategy(FSDP2Strategy):
    """Tensor parallel on ``tp``, then FSDP2 on the data-parallel mesh dimensions.

    Args:
        plan, parallelize_fn: the tensor-parallel plan, as in `TensorParallelStrategy`.
        tp_size: ranks per tensor-parallel group; ``None`` for all devices of a
            host (needs a topology). It must divide the devices per host.
        mp_policy, reshard_after_forward, shard_modules: as in `FSDP2Strategy`.

    Example:
        >>> model = s.parallelize(model, device)  # after s.setup(...)  # doctest: +SKIP
    """

    name = "fsdp2+tp"
    plan: Optional[Mapping[str, ParallelStyle]] = None
    parallelize_fn: Optional[ParallelizeFn] = None
    tp_size: Optional[int] = None

    def __post_init__(self):
        super().__post_init__()
        check_tp_plan(type(self).__name__, self.plan, self.parallelize_fn)
        check_tp_size(type(self).__name__, self.tp_size)

    def _layout(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        tp_size = self.tp_size
        if tp_size is None:
            if topology is None:
                raise ValueError(
                    "FSDP2TPStrategy(tp_size=None) means all devices of a host, but the job "
                    "has no TPU topology to count them; pass tp_size=N (N divides the ranks per slice)"
                )
            tp_size = topology.devices_per_host
        return standard_layout(topology, num_slices, world_size, tp_size=tp_size, fsdp=True)

    def parallelize(self, model: nn.Module, device: "torch.device") -> nn.Module:
        """`model` on `device`: tensor parallel on ``tp``, then ``fully_shard`` on dp."""
        model = to_device(model, device)
        model = apply_tp(model, self.device_mesh["tp"], self.plan, self.parallelize_fn)
        return apply_fsdp(model, dp_mesh(self.device_mesh), self)
