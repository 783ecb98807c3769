"""`Strategy`: how a model is spread over the workers of a job.

A strategy is a small frozen dataclass of settings, checked in ``__post_init__``.
It is used in three steps, the first on the driver and the others in every
worker, in the same order on every rank:

1. ``validate(topology, num_slices, world_size)`` returns the `MeshLayout` or
   raises ``ValueError`` for an impossible layout, before any worker starts;
2. ``setup(device, world_size, topology, num_slices)`` builds the torch
   ``DeviceMesh`` once the process group exists;
3. ``parallelize(model, device)`` moves the model to the device and wraps or
   shards it (DDP, ``fully_shard``, ``parallelize_module``), returning the model
   to train.

Example:
    >>> from ray_train_tpu.strategies import get_strategy
    >>> from ray_train_tpu.topology import Topology
    >>> strategy = get_strategy("fsdp2")
    >>> strategy.validate(Topology.parse("2x2x2", "TPU-V4"), num_slices=2, world_size=16).shape
    (2, 8, 1)
    >>> mesh = strategy.setup(device, world_size=16, topology=t, num_slices=2)  # doctest: +SKIP
    >>> model = strategy.parallelize(model, device)  # doctest: +SKIP
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar, Optional

from ray_train_tpu import _validate as V
from ray_train_tpu.mesh import MeshLayout, build_device_mesh, mesh_layout, mesh_layout_for

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from ray_train_tpu.topology import Topology


# Every concrete strategy by name, in the order their modules were imported;
# filled by `Strategy.__init_subclass__`, read by `registry.get_strategy`.
STRATEGIES: dict[str, type["Strategy"]] = {}
"""Every strategy class by its ``name``; each registers itself when its module is imported."""

# The strategy whose `setup` ran last in this process: its layout decides how
# `ray_train_tpu.data` shards when no rank is given (`prepare.data_parallel_shard`).
_active: Optional["Strategy"] = None


def active_strategy() -> Optional["Strategy"]:
    """The strategy whose ``setup`` built this process's mesh last, or ``None``."""
    return _active


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy(abc.ABC):
    """Base class of the parallelism strategies; see the module docstring.

    A subclass with a ``name`` registers itself under it, so a new strategy is
    one new file in `ray_train_tpu.strategies` (every module there is loaded).
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            if name in STRATEGIES and STRATEGIES[name].__qualname__ != cls.__qualname__:
                raise ValueError(
                    f"strategy name {name!r} of {cls.__qualname__} is taken by "
                    f"{STRATEGIES[name].__qualname__}; give the new strategy another name"
                )
            STRATEGIES[name] = cls
    # Worker-local runtime state, set by `setup`; never compared, printed or pickled.
    _mesh: Optional["DeviceMesh"] = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _mesh_layout: Optional[MeshLayout] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    # Driver side ---------------------------------------------------------
    def validate(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        """The mesh this strategy needs for the job, or ``ValueError`` naming the fix.

        `topology` is ``None`` where there is no TPU slice (GPUs, CPU tests);
        then only `world_size` and `num_slices` constrain the layout.
        """
        _check_job(topology, num_slices, world_size)
        return self._layout(topology, num_slices, world_size)

    @abc.abstractmethod
    def _layout(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        """The layout of this strategy; `validate` has checked the job already."""

    # Worker side ---------------------------------------------------------
    def setup(
        self, device: "torch.device", world_size: int, topology: Optional["Topology"] = None, num_slices: int = 1
    ) -> Optional["DeviceMesh"]:
        """Build this rank's ``DeviceMesh`` (every rank, after ``init_process_group``)."""
        import torch

        layout = self.validate(topology, num_slices, world_size)
        mesh = build_device_mesh(layout, torch.device(device).type)
        # The settings are frozen; the mesh is per-process state that only setup writes.
        object.__setattr__(self, "_mesh", mesh)
        self._activate(layout)
        return mesh

    def _activate(self, layout: MeshLayout) -> None:
        """Record `layout` as this process's mesh (`active_strategy`)."""
        global _active
        object.__setattr__(self, "_mesh_layout", layout)
        _active = self

    @property
    def mesh_layout(self) -> Optional[MeshLayout]:
        """The layout `setup` built in this process, or ``None`` before it."""
        return self._mesh_layout

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The mesh built by `setup`."""
        if self._mesh is None:
            raise RuntimeError(
                f"{type(self).__name__} has no device mesh yet: call "
                "strategy.setup(device, world_size, topology, num_slices) in the worker "
                "before parallelize()"
            )
        return self._mesh

    @abc.abstractmethod
    def parallelize(self, model: "nn.Module", device: "torch.device") -> "nn.Module":
        """Move `model` to `device` and apply the strategy; train what it returns."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` for ``DistributedSampler``: ranks of one
        tensor-parallel group read the same data, data-parallel ranks (mesh
        dimensions whose names start with ``dp``) read different shards."""
        rank, size = 0, 1
        coords = self.device_mesh.get_coordinate()
        for name, coord, n in zip(self.device_mesh.mesh_dim_names, coords, self.device_mesh.shape):
            if name.startswith("dp"):
                rank, size = rank * n + coord, size * n
        return {"num_replicas": size, "rank": rank}

    def __getstate__(self) -> dict:
        # A strategy shipped to another process must not carry this one's mesh.
        state = dict(self.__dict__)
        state.pop("_mesh", None)
        state.pop("_mesh_layout", None)
        return state


def _check_job(topology: Optional["Topology"], num_slices: int, world_size: int) -> None:
    V.check_num_slices("", num_slices)
    V.check_int("", "world_size", world_size, min=1)
    if topology is not None and world_size != topology.num_devices * num_slices:
        raise ValueError(
            f"world_size {world_size} does not fill num_slices={num_slices} x {topology}: "
            f"ray_train_tpu runs one worker per device, {topology.num_devices * num_slices} "
            "in all; size the job with TPUScalingConfig(topology=..., num_slices=...)"
        )


def standard_layout(
    topology: Optional["Topology"], num_slices: int, world_size: int, *, tp_size: int, fsdp: bool
) -> MeshLayout:
    """`mesh_layout_for` the topology, or `mesh_layout` of the world size without one."""
    if topology is not None:
        return mesh_layout_for(topology, num_slices=num_slices, tp_size=tp_size, fsdp=fsdp)
    return mesh_layout(world_size, tp_size=tp_size, num_slices=num_slices, fsdp=fsdp)


def dp_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    """The data-parallel sub-mesh for ``fully_shard``: ``dp_shard`` alone (FSDP), or
    (``dp_replicate``, ``dp_shard``) for HSDP across slices."""
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]


def to_device(model: "nn.Module", device: "torch.device") -> "nn.Module":
    """``model.to(device)``, keeping tied parameters tied, except for a model on
    the meta device: that one is materialized after sharding (``to_empty``),
    never copied whole.

    A "tpu" tensor (torch_tpu's PrivateUse1 backend, like XLA's) cannot take a
    host tensor's place in a parameter (``_has_compatible_shallow_copy_type``
    is false between them), so ``Module.to`` makes a new parameter per module:
    a tied embedding and output layer become two, trained apart. torch_tpu's own
    trainer re-ties Hugging Face models (``tie_weights()``); here every
    parameter that had several names gets its one tensor back, for any model.
    """
    if any(p.is_meta for p in model.parameters()):
        return model
    ties = tied_parameter_names(model)
    model = model.to(device)
    for names in ties:
        shared = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    return model


def tied_parameter_names(model: "nn.Module") -> list[list[str]]:
    """The names of every parameter that has more than one, grouped per tensor."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]
