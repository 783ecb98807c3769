"""TPU slice topologies: one table of per-generation facts, and `Topology`.

A topology string such as ``"4x4"`` or ``"2x2x2"`` gives the mesh bounds of a
slice in chips. Together with the generation it fixes everything else: how many
hosts the slice has, how many chips each host holds, the pod type Ray and GCP
name it by (``v6e-16``), and which chip sits where.

Conventions follow torch_tpu's launcher
(``torch_tpu/_internal/distributed/distributed.py``): multi-host slices are
built from hosts of 2x2x1 chips; hosts are ordered Z-major, Y, X-minor
(``sorted(hosts, key=lambda h: h[::-1])``), and the host at position *k* in that
order is TPU worker id *k* and ``NODE_RANK`` *k*. Chips inside a host are
numbered X-minor too, which is the order of ``TPU_VISIBLE_CHIPS``.

What a worker is (decision, see README "One device per worker"): one Ray Train
worker drives one TorchTPU device. torch_tpu requires exactly one process per
device. On v4 and v5p the two TensorCores of a chip are fused ("megacore") into
one device, and v5e/v6e chips have one core, so there a worker is a chip. On
v7x each chip exposes two devices (torch_tpu ``hardware._DEVICES_PER_CHIP``),
so a worker is a TensorCore, and Ray must count two TPU resources per chip
(``RAY_TPU_RESOURCE_PER_CHIP=2``) so that ``{"TPU": 1}`` means one device.

Example:
    >>> t = Topology.parse("4x4", accelerator_type="TPU-V6E")
    >>> (t.num_chips, t.num_hosts, t.chips_per_host, t.pod_type)
    (16, 4, 4, 'v6e-16')
    >>> t.chip_coords(worker_id=1, local_index=0)
    (2, 0, 0)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Iterable

Coords = tuple[int, int, int]

_MULTI_HOST_CHIP_BOUNDS: Coords = (2, 2, 1)

# Longest topology or pod-type string accepted: real ones ("16x16x24",
# "2,2,1,2", "v5litepod-256") are well under it; longer input is refused before
# Python's int() sees thousands of digits.
MAX_TOPOLOGY_LENGTH = 32


def _grid_3d(sizes: Iterable[int], max_dims: Coords) -> frozenset[str]:
    """Every AxBxC with A, B, C from `sizes`, bounded by `max_dims`."""
    sizes = tuple(sizes)
    return frozenset(
        f"{x}x{y}x{z}"
        for x, y, z in itertools.product(sizes, sizes, sizes)
        if x <= max_dims[0] and y <= max_dims[1] and z <= max_dims[2]
    )


_SMALL_3D = frozenset({"2x2x1", "2x2x2", "2x2x4", "2x4x4"})
_SINGLE_CORE_2D = frozenset({"1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
    """Facts about one TPU generation. Sources: cloud.google.com/tpu/docs/<gen>,
    torch_tpu ``_internal/utils/hardware.py``, Ray ``_private/accelerators/tpu.py``."""

    accelerator_type: str  # Ray's accelerator type, e.g. "TPU-V6E"
    pod_prefix: str  # pod-type spelling of Ray and GCP, e.g. "v6e" in "v6e-16"
    gke_accelerator: str  # GKE node label cloud.google.com/gke-tpu-accelerator
    num_dims: int  # 2 for the 2-D torus generations, 3 for the 3-D ones
    cores_per_chip: int  # TensorCores per chip, as pod-type names count them
    devices_per_chip: int  # TorchTPU devices per chip = Ray Train workers per chip
    max_single_host_chips: int  # largest slice that fits on one host
    topologies: frozenset[str]
    peak_bf16_flops_per_chip: float
    hbm_bytes_per_chip: int

    @property
    def peak_bf16_flops_per_device(self) -> float:
        return self.peak_bf16_flops_per_chip / self.devices_per_chip


GENERATIONS: dict[str, Generation] = {
    g.accelerator_type: g
    for g in (
        Generation(
            accelerator_type="TPU-V4",
            pod_prefix="v4",
            gke_accelerator="tpu-v4-podslice",
            num_dims=3,
            cores_per_chip=2,
            devices_per_chip=1,  # megacore
            max_single_host_chips=4,
            topologies=_SMALL_3D | _grid_3d((4, 8, 12, 16), (16, 16, 16)),
            peak_bf16_flops_per_chip=275e12,
            hbm_bytes_per_chip=32 * 2**30,
        ),
        Generation(
            accelerator_type="TPU-V5P",
            pod_prefix="v5p",
            gke_accelerator="tpu-v5p-slice",
            num_dims=3,
            cores_per_chip=2,
            devices_per_chip=1,  # megacore
            max_single_host_chips=4,
            topologies=_SMALL_3D | _grid_3d((4, 8, 12, 16, 20, 24), (16, 16, 24)),
            peak_bf16_flops_per_chip=459e12,
            hbm_bytes_per_chip=95 * 2**30,
        ),
        Generation(
            accelerator_type="TPU-V5LITEPOD",
            pod_prefix="v5litepod",
            gke_accelerator="tpu-v5-lite-podslice",
            num_dims=2,
            cores_per_chip=1,
            devices_per_chip=1,
            max_single_host_chips=8,
            topologies=_SINGLE_CORE_2D,
            peak_bf16_flops_per_chip=197e12,
            hbm_bytes_per_chip=16 * 2**30,
        ),
        Generation(
            accelerator_type="TPU-V6E",
            pod_prefix="v6e",
            gke_accelerator="tpu-v6e-slice",
            num_dims=2,
            cores_per_chip=1,
            devices_per_chip=1,
            max_single_host_chips=8,
            topologies=_SINGLE_CORE_2D,
            peak_bf16_flops_per_chip=918e12,
            hbm_bytes_per_chip=32 * 2**30,
        ),
        Generation(
            accelerator_type="TPU-V7X",
            pod_prefix="v7x",
            gke_accelerator="tpu7x",
            num_dims=3,
            cores_per_chip=2,
            devices_per_chip=2,  # two TensorCores, two TorchTPU devices
            max_single_host_chips=4,
            topologies=_SMALL_3D
            | frozenset(
                {"4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16"}
            ),
            peak_bf16_flops_per_chip=2307e12,
            hbm_bytes_per_chip=192 * 2**30,
        ),
    )
}

# Other spellings users and tools write for the same generation.
_ALIASES = {
    "V4": "TPU-V4",
    "V5P": "TPU-V5P",
    "V5E": "TPU-V5LITEPOD",
    "V5LITEPOD": "TPU-V5LITEPOD",
    "TPU-V5E": "TPU-V5LITEPOD",
    "V6E": "TPU-V6E",
    "V7X": "TPU-V7X",
    "TPU7X": "TPU-V7X",
}


# TorchTPU devices on the largest host of any generation: ports count up from a
# base port by one per device of a host.
MAX_DEVICES_PER_HOST = max(
    max(g.max_single_host_chips, 4) * g.devices_per_chip for g in GENERATIONS.values()
)


def get_generation(accelerator_type: str) -> Generation:
    """The `Generation` for an accelerator type such as ``"TPU-V6E"`` or ``"v6e"``."""
    if not isinstance(accelerator_type, str):
        raise TypeError(
            f"accelerator_type must be a string such as 'TPU-V6E', got "
            f"{type(accelerator_type).__name__} {accelerator_type!r}"
        )
    key = accelerator_type.strip().upper()
    key = _ALIASES.get(key, key)
    if key not in GENERATIONS:
        raise ValueError(
            f"accelerator_type {accelerator_type!r} is not a supported TPU "
            f"generation; valid: {', '.join(GENERATIONS)}"
        )
    return GENERATIONS[key]


def parse_pod_type(pod_type: str) -> tuple[Generation, int]:
    """The one pod-type parser: ``"v4-16"`` -> (TPU-V4's `Generation`, 16 TensorCores).

    Accepts Ray's and GCP's spellings (``"v6e-16"``, ``"v5litepod-8"``,
    ``"tpu7x-8"``), in any case.

    Example:
        >>> gen, cores = parse_pod_type("v4-16")
        >>> gen.accelerator_type, cores
        ('TPU-V4', 16)
    """
    text = pod_type.strip() if isinstance(pod_type, str) else ""
    prefix, _, cores = text.rpartition("-")
    if not prefix or not cores.isdecimal() or len(text) > MAX_TOPOLOGY_LENGTH:
        raise ValueError(
            f"pod type {pod_type!r} is not '<generation>-<TensorCores>' such as 'v4-16' or "
            f"'v6e-16'; generations: {', '.join(g.pod_prefix for g in GENERATIONS.values())}"
        )
    return get_generation(prefix), int(cores)


def generation_of(name: str) -> Generation:
    """The `Generation` named by an accelerator type (``"TPU-V4"``, ``"v6e"``) or
    a pod type (``"v4-16"``).

    Example:
        >>> generation_of("TPU-V4").pod_prefix, generation_of("tpu7x-8").accelerator_type
        ('v4', 'TPU-V7X')
    """
    try:
        return get_generation(name)
    except ValueError as e:
        try:
            return parse_pod_type(name)[0]
        except ValueError:
            raise e from None


def generation_of_pod_type(pod_type: "str | None") -> "str | None":
    """``"v4-16"`` -> ``"TPU-V4"``; None for an empty value."""
    return generation_of(pod_type).accelerator_type if pod_type else None


def normalize_pod_type(text: str) -> str:
    """A ``TPU_ACCELERATOR_TYPE`` value as Ray spells the pod type in its labels:
    lower case, no ``tpu-`` prefix (``"TPU-v4-16"`` -> ``"v4-16"``).

    Example:
        >>> normalize_pod_type("TPU-V6E-16"), normalize_pod_type("tpu7x-8")
        ('v6e-16', 'v7x-8')
    """
    return re.sub(r"^tpu-?v?", "v", text.strip().lower())


def _sort_key(topology: str) -> tuple[int, ...]:
    dims = tuple(int(d) for d in topology.split("x"))
    return (_prod(dims),) + dims


def _prod(dims: Iterable[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def valid_topologies(accelerator_type: str) -> list[str]:
    """Valid slice topologies of a generation, smallest first."""
    return sorted(get_generation(accelerator_type).topologies, key=_sort_key)


def _invalid(topology: object, gen: Generation, rule: str) -> ValueError:
    return ValueError(
        f"topology {topology!r} is not a {gen.accelerator_type} slice ({rule}); "
        f"valid: {', '.join(valid_topologies(gen.accelerator_type))}"
    )


def _parse_dims(topology: object, gen: Generation) -> tuple[int, ...]:
    if not isinstance(topology, str):
        raise _invalid(topology, gen, "expected a string such as '4x4' or '2x2x2'")
    if len(topology) > MAX_TOPOLOGY_LENGTH:
        raise ValueError(
            f"topology {topology[:24]!r}... is {len(topology)} characters long; the longest "
            f"real slice name has fewer than {MAX_TOPOLOGY_LENGTH} (e.g. '16x16x24'); "
            f"valid for {gen.accelerator_type}: {', '.join(valid_topologies(gen.accelerator_type))}"
        )
    text = topology.strip().lower()
    if not re.fullmatch(r"\d+([x,]\d+){1,3}", text):
        raise _invalid(topology, gen, "expected integers separated by 'x' or ','")
    dims = [int(d) for d in re.split(r"[x,]", text)]
    if len(dims) == 4:
        # torch_tpu writes v7x meshes with a fourth field: cores per chip.
        if dims[3] != gen.devices_per_chip or gen.devices_per_chip == 1:
            raise _invalid(
                topology, gen, f"a fourth field is the cores per chip, "
                f"{gen.devices_per_chip} on {gen.accelerator_type}"
            )
        dims = dims[:3]
    if gen.num_dims == 2 and len(dims) == 3 and dims[2] == 1:
        dims = dims[:2]
    if gen.num_dims == 3 and len(dims) == 2:
        dims = dims + [1]
    return tuple(dims)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice: generation, mesh bounds in chips, and hosts.

    Build it with `Topology.parse`. Worker id *k* is the host at position *k* of
    `host_coords` (Z-major, Y, X-minor, as torch_tpu orders hosts).
    """

    generation: Generation
    name: str  # canonical, e.g. "4x4" or "2x2x2"
    bounds: Coords  # mesh bounds in chips (X, Y, Z)
    host_bounds: Coords  # chips per host along (X, Y, Z)

    @classmethod
    def parse(cls, topology: str, accelerator_type: str) -> "Topology":
        """Parse ``"4x4"``, ``"4X4"``, ``"2x2x2"`` or ``"2,2,1"`` for a generation.

        Raises:
            ValueError: naming the topology and listing the valid ones.
        """
        gen = get_generation(accelerator_type)
        dims = _parse_dims(topology, gen)
        if len(dims) != gen.num_dims:
            raise _invalid(topology, gen, f"{gen.num_dims} dimensions expected")
        name = "x".join(str(d) for d in dims)
        if name not in gen.topologies:
            raise _invalid(topology, gen, "no such slice shape")
        bounds = tuple(dims) + (1,) * (3 - len(dims))
        # A slice small enough for one host is that host; larger ones are
        # tiled with 2x2x1-chip hosts, as torch_tpu and Ray assume.
        host_bounds = bounds if _prod(bounds) <= gen.max_single_host_chips else _MULTI_HOST_CHIP_BOUNDS
        return cls(generation=gen, name=name, bounds=bounds, host_bounds=host_bounds)

    # Sizes -----------------------------------------------------------------
    @property
    def accelerator_type(self) -> str:
        return self.generation.accelerator_type

    @property
    def num_chips(self) -> int:
        return _prod(self.bounds)

    @property
    def chips_per_host(self) -> int:
        return _prod(self.host_bounds)

    @property
    def num_hosts(self) -> int:
        return self.num_chips // self.chips_per_host

    @property
    def devices_per_chip(self) -> int:
        return self.generation.devices_per_chip

    @property
    def devices_per_host(self) -> int:
        """TorchTPU devices, and so Ray Train workers, per host."""
        return self.chips_per_host * self.devices_per_chip

    @property
    def num_devices(self) -> int:
        """TorchTPU devices, and so Ray Train workers, in the slice."""
        return self.num_chips * self.devices_per_chip

    @property
    def is_multi_host(self) -> bool:
        return self.num_hosts > 1

    # Names -----------------------------------------------------------------
    @property
    def pod_type(self) -> str:
        """Pod type as Ray and GCP spell it: cores in the slice, e.g. ``v4-16``."""
        cores = self.num_chips * self.generation.cores_per_chip
        return f"{self.generation.pod_prefix}-{cores}"

    @property
    def torch_tpu_topology(self) -> str:
        """The whole slice's mesh bounds as ``TORCH_TPU_TOPOLOGY`` spells them
        (``"4,4,1"``; v7x adds the cores per chip: ``"2,2,2,2"``)."""
        fields = list(self.bounds)
        if self.devices_per_chip > 1:
            fields.append(self.devices_per_chip)
        return ",".join(str(f) for f in fields)

    # Coordinates -----------------------------------------------------------
    @functools.cached_property
    def host_coords(self) -> tuple[Coords, ...]:
        """Host grid coordinates in TPU worker id order (Z-major, Y, X-minor)."""
        grid = tuple(b // h for b, h in zip(self.bounds, self.host_bounds))
        hosts = list(itertools.product(*(range(n) for n in grid)))
        hosts.sort(key=lambda h: h[::-1])
        return tuple(hosts)

    def chip_coords(self, worker_id: int, local_index: int) -> Coords:
        """Global coordinates of chip `local_index` (X-minor) on host `worker_id`."""
        if not 0 <= worker_id < self.num_hosts:
            raise ValueError(
                f"worker_id {worker_id} is outside the {self.num_hosts} hosts of "
                f"{self.pod_type}; valid: 0..{self.num_hosts - 1}"
            )
        if not 0 <= local_index < self.chips_per_host:
            raise ValueError(
                f"local_index {local_index} is outside the {self.chips_per_host} "
                f"chips of a {self.pod_type} host; valid: 0..{self.chips_per_host - 1}"
            )
        cx, cy, _ = self.host_bounds
        local = (local_index % cx, (local_index // cx) % cy, local_index // (cx * cy))
        host = self.host_coords[worker_id]
        return tuple(h * c + l for h, c, l in zip(host, self.host_bounds, local))

    def host_of_chip(self, coords: Coords) -> int:
        """TPU worker id of the host that holds the chip at `coords`."""
        host = tuple(c // h for c, h in zip(coords, self.host_bounds))
        try:
            return self._host_index[host]
        except KeyError:
            raise ValueError(
                f"chip {tuple(coords)} is outside the {self.name} mesh {self.bounds}"
            ) from None

    @functools.cached_property
    def _host_index(self) -> dict[Coords, int]:
        return {h: i for i, h in enumerate(self.host_coords)}

    def __str__(self) -> str:
        return f"{self.accelerator_type} {self.name} ({self.pod_type})"
