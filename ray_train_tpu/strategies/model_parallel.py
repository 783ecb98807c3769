"""`ModelParallelStrategy`: the user's own ``parallelize_fn(model, mesh)`` on a mesh they shape.

Lightning Fabric's ``ModelParallelStrategy`` is the model: instead of growing
options, the strategy builds the ``DeviceMesh`` and hands it, with the model, to
a function that applies any mix of ``parallelize_module`` and ``fully_shard``.

Mesh dimensions whose names start with ``dp`` are data parallel (they decide
`distributed_sampler_kwargs`); a dimension named ``tp`` must be innermost and,
on a TPU slice, divide the devices per host, so that it stays on one host.

Example:
    >>> def parallelize(model, mesh):
    ...     from torch.distributed.fsdp import fully_shard
    ...     return fully_shard(model, mesh=mesh["dp_shard"])
    >>> s = ModelParallelStrategy(parallelize_fn=parallelize, mesh_shape=(4,), mesh_dim_names=("dp_shard",))
    >>> s.validate(None, num_slices=1, world_size=4)
    MeshLayout(shape=(4,), dim_names=('dp_shard',))
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

from torch import nn

from ray_train_tpu.mesh import MeshLayout
from ray_train_tpu.strategies.base import Strategy, standard_layout, to_device

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ray_train_tpu.topology import Topology


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelParallelStrategy(Strategy):
    """A user ``parallelize_fn(model, mesh) -> model`` on a mesh of any shape.

    Args:
        parallelize_fn: receives the model (on the device) and the whole ``DeviceMesh``.
        mesh_shape, mesh_dim_names: the mesh, outermost first; the shape must
            multiply to the world size. ``None`` for both: the standard
            (``dp_replicate``, ``dp_shard``, ``tp``) layout with ``tp`` = 1.
    """

    name = "model_parallel"
    parallelize_fn: Optional[Callable[[nn.Module, "DeviceMesh"], nn.Module]] = None
    mesh_shape: Optional[tuple[int, ...]] = None
    mesh_dim_names: Optional[tuple[str, ...]] = None

    def __post_init__(self):
        if not callable(self.parallelize_fn):
            raise ValueError(
                f"ModelParallelStrategy(parallelize_fn={self.parallelize_fn!r}) must be a function "
                "fn(model, mesh) -> model that applies parallelize_module / fully_shard; e.g. "
                "ModelParallelStrategy(parallelize_fn=my_parallelize)"
            )
        if (self.mesh_shape is None) != (self.mesh_dim_names is None):
            raise ValueError(
                f"ModelParallelStrategy needs both mesh_shape and mesh_dim_names, or neither; got "
                f"mesh_shape={self.mesh_shape!r}, mesh_dim_names={self.mesh_dim_names!r}"
            )
        if self.mesh_shape is not None:
            layout = MeshLayout(shape=tuple(self.mesh_shape), dim_names=tuple(self.mesh_dim_names))
            object.__setattr__(self, "mesh_shape", layout.shape)  # frozen: tuples, not the caller's lists
            object.__setattr__(self, "mesh_dim_names", layout.dim_names)

    def _layout(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        if self.mesh_shape is None:
            return standard_layout(topology, num_slices, world_size, tp_size=1, fsdp=True)
        layout = MeshLayout(shape=self.mesh_shape, dim_names=self.mesh_dim_names)
        if layout.world_size != world_size:
            raise ValueError(
                f"ModelParallelStrategy(mesh_shape={layout.shape}) has {layout.world_size} ranks but "
                f"world_size is {world_size}; the product of mesh_shape must equal the world size"
            )
        if "tp" in layout.dim_names:
            tp = layout.size("tp")
            if layout.dim_names[-1] != "tp":
                raise ValueError(
                    f"ModelParallelStrategy(mesh_dim_names={layout.dim_names}) puts 'tp' before other "
                    "dimensions; 'tp' must be last (innermost) so that a tp group is consecutive ranks on one host"
                )
            if topology is not None and topology.devices_per_host % tp:
                raise ValueError(
                    f"mesh dimension 'tp' of size {tp} does not divide the {topology.devices_per_host} "
                    f"devices per host of {topology}; choose a divisor of {topology.devices_per_host}"
                )
        return layout

    def parallelize(self, model: nn.Module, device: "torch.device") -> nn.Module:
        """`model` on `device`, then ``parallelize_fn(model, mesh)``."""
        model = to_device(model, device)
        out = self.parallelize_fn(model, self.device_mesh)
        if not isinstance(out, nn.Module):
            raise TypeError(
                f"parallelize_fn must return the parallelized nn.Module, got {type(out).__name__}; "
                "end it with `return model`"
            )
        return out
