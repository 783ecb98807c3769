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
import functools
import logging
from typing import TYPE_CHECKING, Optional

from ray_train_tpu import _validate as V
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
        self.validate(topology, num_slices, world_size)
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


def fixed_order_ddp(model: "nn.Module", **kwargs) -> "DistributedDataParallel":
    """``DistributedDataParallel(model, **kwargs)`` whose gradient buckets are the
    same at every step of every run, so that a run resumed from a checkpoint sums
    gradients in the same order as an uninterrupted one (bitwise equal results).

    Plain DDP (without ``find_unused_parameters``) reduces its first step in one
    bucket and then rebuilds the buckets in the order the gradients became ready;
    a run resumed at step k thus reduces step k in one bucket where the
    uninterrupted run used the rebuilt ones, and with more than two ranks the
    all-reduce rounds differently (7.5e-9 after one resume). Here the rebuild is
    requested before the first forward (``Reducer._push_all_rebuilt_params``, what
    DDP's own ``Join`` support calls), from the parameters in reverse module order
    (the order backward produces them in, as DDP's own first guess assumes), so it
    happens once, identically in every run, the last layers' bucket is reduced
    first (all-reduce still overlaps the backward), and no per-step work is added.
    """
    ddp = _fixed_order_class()(model, **kwargs)
    ddp.reducer._push_all_rebuilt_params()  # torch >= 1.10; tests/unit/test_strategies.py checks the buckets
    return ddp


@functools.lru_cache(maxsize=None)
def _fixed_order_class():
    from torch.nn.parallel import DistributedDataParallel

    class FixedOrderDDP(DistributedDataParallel):
        """DDP whose reducer numbers the parameters in reverse module order."""

        def _build_params_for_reducer(self):
            params, sparse = super()._build_params_for_reducer()
            return params[::-1], sparse[::-1]

    FixedOrderDDP.__module__, FixedOrderDDP.__qualname__ = __name__, "FixedOrderDDP"
    return FixedOrderDDP


def __getattr__(name: str):
    # ``FixedOrderDDP`` without importing torch with this module (pickle finds it here).
    if name == "FixedOrderDDP":
        return _fixed_order_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
