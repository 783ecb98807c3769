"""The device mesh of a job: which ranks form data-parallel and tensor-parallel groups.

`mesh_layout` is a pure function (no torch, no Ray): the driver calls it to
reject an impossible layout before any worker starts, ``plan`` can print it,
and every worker builds the same mesh from it with `build_device_mesh`.

Every layout has the same three dimensions, outermost first (torchtitan's
``ParallelDims`` names):

- ``dp_replicate``: data-parallel replicas. With FSDP it is the number of
  slices (HSDP: parameters are replicated across slices, over DCN); without
  FSDP it holds every data-parallel rank.
- ``dp_shard``: FSDP shards inside a slice (1 without FSDP).
- ``tp``: tensor-parallel ranks, innermost (1 without TP).

Size-1 dimensions are kept, never dropped, so that code can always name
``mesh["tp"]`` or ``mesh["dp_shard"]`` and a layout's shape never changes
length with the sizes. A mesh is row-major over ranks, and ranks are
slice-major, then host, then device on the host (`launch_env.worker_place`),
so a ``tp`` group is ``tp_size`` consecutive ranks: neighbouring chips of one
host, as long as ``tp_size`` divides the devices per host. Slices are the
outermost blocks of ranks, so with FSDP the only collectives that cross DCN
are the gradient all-reduces over ``dp_replicate``.

Example:
    >>> mesh_layout(16, tp_size=2, num_slices=2, devices_per_host=4)
    MeshLayout(shape=(2, 4, 2), dim_names=('dp_replicate', 'dp_shard', 'tp'))
    >>> mesh_layout(8, tp_size=2, fsdp=False).shape
    (4, 1, 2)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ray_train_tpu.topology import Topology

DIM_NAMES: tuple[str, str, str] = ("dp_replicate", "dp_shard", "tp")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """The shape of a device mesh and the names of its dimensions, outermost first."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.dim_names):
            raise ValueError(
                f"MeshLayout(shape={self.shape}, dim_names={self.dim_names}) needs one "
                "name per dimension; give as many names as sizes"
            )
        if len(set(self.dim_names)) != len(self.dim_names):
            raise ValueError(f"MeshLayout(dim_names={self.dim_names}) repeats a name; names must be unique")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in self.shape):
            raise ValueError(f"MeshLayout(shape={self.shape}) must hold integers >= 1")

    @property
    def world_size(self) -> int:
        """Ranks in the mesh: the product of its shape."""
        out = 1
        for s in self.shape:
            out *= s
        return out

    def size(self, name: str) -> int:
        """Size of the dimension `name`; 1 for a name the layout does not have."""
        return dict(zip(self.dim_names, self.shape)).get(name, 1)

    def data_parallel(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, dp_size)`` of global `rank`: its place among the
        data-parallel replicas, which read different data. The dimensions whose
        names start with ``dp`` are data parallel; the others (``tp``) hold
        peers that read the same batch. The mesh is row-major over ranks, as
        torch's ``init_device_mesh`` lays it out.

        Example:
            >>> layout = mesh_layout(8, tp_size=2)          # (1, 4, 2)
            >>> [layout.data_parallel(r) for r in range(4)]
            [(0, 4), (0, 4), (1, 4), (1, 4)]
        """
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank={rank!r} is not a rank of mesh {dict(zip(self.dim_names, self.shape))}; "
                f"ranks are 0..{self.world_size - 1}"
            )
        coords, rest = [], rank
        for n in reversed(self.shape):
            coords.append(rest % n)
            rest //= n
        dp_rank, dp_size = 0, 1
        for name, coord, n in zip(self.dim_names, reversed(coords), self.shape):
            if name.startswith("dp"):
                dp_rank, dp_size = dp_rank * n + coord, dp_size * n
        return dp_rank, dp_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(values: list[int]) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


def _check_count(field: str, value: object) -> int:
    from ray_train_tpu import _validate as V

    return V.check_int("", field, value, min=1)


def mesh_layout(
    world_size: int,
    *,
    tp_size: int = 1,
    num_slices: int = 1,
    devices_per_host: Optional[int] = None,
    fsdp: bool = True,
) -> MeshLayout:
    """Lay out `world_size` ranks as (``dp_replicate``, ``dp_shard``, ``tp``).

    Args:
        world_size: ranks in the job (one per TPU device).
        tp_size: tensor-parallel group size; groups are consecutive ranks on one host.
        num_slices: TPU slices in the job; ranks are slice-major.
        devices_per_host: devices per host, to keep each ``tp`` group on one host.
            ``None`` skips that check (e.g. a CPU test without hosts).
        fsdp: shard parameters inside each slice (``dp_shard``) and replicate
            across slices (``dp_replicate`` = `num_slices`, HSDP); ``False``
            puts every data-parallel rank in ``dp_replicate`` (DDP).

    Raises:
        ValueError: naming the field, the value, the rule and valid values.

    Example:
        >>> mesh_layout(8, tp_size=4, devices_per_host=4).shape
        (1, 2, 4)
        >>> mesh_layout(8, tp_size=3, devices_per_host=4)
        Traceback (most recent call last):
        ...
        ValueError: tp_size=3 does not divide the 4 devices per host; use 1, 2 or 4
    """
    return _layout(world_size, tp_size, num_slices, devices_per_host, fsdp, where="")


def _layout(
    world_size: int, tp_size: int, num_slices: int, devices_per_host: Optional[int], fsdp: bool, where: str
) -> MeshLayout:
    _check_count("world_size", world_size)
    _check_count("tp_size", tp_size)
    _check_count("num_slices", num_slices)
    if world_size % num_slices:
        raise ValueError(
            f"world_size {world_size} is not a multiple of num_slices={num_slices}: every "
            f"slice has the same number of ranks; use num_slices {_or_list(_divisors(world_size))}"
        )
    if devices_per_host is not None:
        _check_count("devices_per_host", devices_per_host)
        if devices_per_host % tp_size:
            raise ValueError(
                f"tp_size={tp_size} does not divide the {devices_per_host} devices per host{where}; "
                f"use {_or_list(_divisors(devices_per_host))}"
            )
    per_slice = world_size // num_slices
    if per_slice % tp_size:
        valid = _divisors(per_slice)
        if devices_per_host is not None:
            valid = [d for d in valid if devices_per_host % d == 0]
        raise ValueError(
            f"world_size {world_size} is not a multiple of num_slices * tp_size = "
            f"{num_slices} * {tp_size}: a tp group cannot span slices; use tp_size {_or_list(valid)}"
        )
    dp = world_size // tp_size
    shape = (num_slices, per_slice // tp_size, tp_size) if fsdp else (dp, 1, tp_size)
    return MeshLayout(shape=shape, dim_names=DIM_NAMES)


def mesh_layout_for(topology: "Topology", num_slices: int = 1, tp_size: int = 1, fsdp: bool = True) -> MeshLayout:
    """`mesh_layout` for whole slices of `topology`: one rank per device.

    Example:
        >>> from ray_train_tpu.topology import Topology
        >>> mesh_layout_for(Topology.parse("2x2x2", "TPU-V4"), num_slices=2, tp_size=2).shape
        (2, 4, 2)
        >>> mesh_layout_for(Topology.parse("2x2x2", "TPU-V4"), tp_size=3)
        Traceback (most recent call last):
        ...
        ValueError: tp_size=3 does not divide the 4 devices per host of TPU-V4 2x2x2 (v4-16); use 1, 2 or 4
    """
    _check_count("num_slices", num_slices)
    return _layout(
        topology.num_devices * num_slices, tp_size, num_slices, topology.devices_per_host, fsdp, where=f" of {topology}"
    )


def build_device_mesh(layout: MeshLayout, device_type: str) -> "DeviceMesh":
    """Worker side: the torch ``DeviceMesh`` of `layout` over the default process group.

    Every rank must call it, in the same order, after ``init_process_group``.

    Example:
        >>> mesh = build_device_mesh(mesh_layout(4, tp_size=2), "cpu")  # doctest: +SKIP
        >>> mesh["tp"].size(), mesh["dp_shard"].size()  # doctest: +SKIP
        (2, 2)
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError(
            "build_device_mesh needs torch.distributed initialized; call it in a worker "
            "after the process group exists (TPUTorchConfig sets it up)"
        )
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"mesh {dict(zip(layout.dim_names, layout.shape))} has {layout.world_size} ranks "
            f"but the process group has {dist.get_world_size()}; the product of the mesh "
            "shape must equal the world size"
        )
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.dim_names)
