"""`DDPStrategy`: replicate the model on every worker and average gradients (DDP).

Unlike ``ray.train.torch.prepare_model`` in Ray 2.60, which passes
``device_ids=[device]`` on TPU, the model is wrapped *without* ``device_ids`` on
``tpu`` (torch_tpu's DDP must be built without them) and on ``cpu`` (DDP
rejects them there); only ``cuda`` gets ``device_ids=[device]``.

Example:
    >>> from ray_train_tpu.strategies import DDPStrategy
    >>> DDPStrategy().validate(None, num_slices=1, world_size=4).shape
    (4, 1, 1)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Optional

from ray_train_tpu import _validate as V
from ray_train_tpu._compat.torch import fixed_order_ddp  # noqa: F401  (re-exported)
from ray_train_tpu.mesh import MeshLayout
from ray_train_tpu.strategies.base import Strategy, standard_layout, to_device

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the default process group.

    Args:
        find_unused_parameters: as in ``DistributedDataParallel``.
        fixed_bucket_order: fix the gradient buckets before the first step (see
            `fixed_order_ddp`), so a run resumed from a checkpoint is bitwise equal
            to an uninterrupted one; ``False`` keeps DDP's own rebuild after step 1.

    Example:
        >>> model = DDPStrategy().parallelize(model, device)  # doctest: +SKIP
    """

    name = "ddp"
    find_unused_parameters: bool = False
    fixed_bucket_order: bool = True

    def __post_init__(self):
        V.check_bool("DDPStrategy", "find_unused_parameters", self.find_unused_parameters)
        V.check_bool("DDPStrategy", "fixed_bucket_order", self.fixed_bucket_order)

    def _layout(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        return standard_layout(topology, num_slices, world_size, tp_size=1, fsdp=False)

    def setup(
        self, device: "torch.device", world_size: int, topology: Optional["Topology"] = None, num_slices: int = 1
    ) -> Optional["DeviceMesh"]:
        """Check the job; DDP uses the default process group, so no mesh is built."""
        self._activate(self.validate(topology, num_slices, world_size))
        return None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        import torch.distributed as dist

        if not dist.is_initialized():
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": dist.get_world_size(), "rank": dist.get_rank()}

    def parallelize(self, model: "nn.Module", device: "torch.device") -> "nn.Module":
        """`model` on `device`, wrapped in DDP unless the job has one worker."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        device = torch.device(device)
        model = to_device(model, device)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            logger.info("ray_train_tpu: world_size 1, the model is not wrapped in DistributedDataParallel")
            return model
        kwargs = {"device_ids": [device]} if device.type == "cuda" else {}
        if self.fixed_bucket_order and not self.find_unused_parameters:
            return fixed_order_ddp(model, **kwargs)
        return DistributedDataParallel(model, find_unused_parameters=self.find_unused_parameters, **kwargs)
