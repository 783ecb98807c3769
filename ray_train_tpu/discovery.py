"""From what each Ray worker reports about itself to its place in the job.

Pure: each worker answers with a typed `WorkerReport` (`_worker_fns.report`),
the backend turns those into a `WorkerInfo` per worker and calls `layout`, which
checks that the workers form whole slices with one device each and returns the
rank of every worker and the hosts in slice order, ready for
`launch_env.launch_envs`. Nothing here depends on the order in which Ray
started the workers or the hosts registered.

The hosts of a slice are ordered by `order_slice_hosts`: by their physical chip
coordinates when every host reports them (torch_tpu's launcher derives
``NODE_RANK`` the same way), else by ``TPU_WORKER_ID``. GKE assigns
``TPU_WORKER_ID`` in pod-creation order, which need not follow the ICI mesh
(Ray#66029), and has given two hosts the same id (ai-on-gke#858): where
coordinates are known, they win, and every host whose id disagrees is named.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter, defaultdict
from typing import Optional, Sequence

from ray_train_tpu import constants as C
from ray_train_tpu.launch_env import rank_of
from ray_train_tpu.topology import Coords, Topology, normalize_pod_type

# Chips per host along (X, Y, Z) of every multi-host slice: torch_tpu's
# ``_CHIPS_PER_HOST`` (torch_tpu/_internal/distributed/distributed.py).
CHIPS_PER_HOST: Coords = (2, 2, 1)


class Mode(str, enum.Enum):
    """How a job's TPU workers run: on real chips, or explicitly simulated on CPU.

    A ``str`` enum, so ``Mode.SIMULATE == "simulate"``.

    Example:
        >>> Mode("simulate") is Mode.SIMULATE, str(Mode.TPU)
        (True, 'tpu')
    """

    TPU = "tpu"
    SIMULATE = "simulate"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What one worker says about itself before the process group exists
    (`ray_train_tpu._worker_fns.report` builds it inside the worker).

    Example:
        >>> r = WorkerReport(node_ip="10.0.0.2", node_id="n", slice_name="s", tpu_worker_id=1,
        ...                  accelerator_type="v4-16", topology="2x2x2", tpu_ids=(3,))
        >>> r.info(index=7, node_tpus=4).where()
        'worker 7 on host 10.0.0.2 (TPU_NAME=s, TPU_WORKER_ID=1)'
    """

    node_ip: str
    node_id: str
    # the host's place (`host_identity`: GKE's variable, else Ray's node label)
    slice_name: Optional[str]  # TPU_NAME / ray.io/tpu-slice-name
    tpu_worker_id: Optional[int]  # TPU_WORKER_ID / ray.io/tpu-worker-id (None if unset or not an integer)
    accelerator_type: Optional[str]  # TPU_ACCELERATOR_TYPE / ray.io/tpu-pod-type (a pod type, e.g. "v4-16")
    topology: Optional[str]  # TPU_TOPOLOGY / ray.io/tpu-topology
    tpu_ids: tuple[int, ...] = ()  # Ray's TPU accelerator ids of this worker
    gpu_ids: tuple[int, ...] = ()
    mode: Mode = Mode.TPU
    preset: dict = dataclasses.field(default_factory=dict)  # our variables already set for it
    # physical (X, Y, Z) of its host's first chip in the slice's mesh, from the one
    # worker per host that asks torch_tpu (`_worker_fns.host_chip_coords`); None otherwise
    chip_coords: Optional[Coords] = None

    def info(self, index: int, node_tpus: float) -> "WorkerInfo":
        """The `WorkerInfo` that `layout` ranks, for the worker at `index`."""
        return WorkerInfo(index=index, node_ip=self.node_ip, slice_name=self.slice_name,
                          tpu_worker_id=self.tpu_worker_id, tpu_ids=self.tpu_ids, node_tpus=node_tpus,
                          chip_coords=self.chip_coords)

    def as_dict(self) -> dict:
        """The report as the dict that `ray_train_tpu.serve` reads (``worker_id``
        as a string, ``simulate`` as a bool)."""
        out = dataclasses.asdict(self)
        out["worker_id"] = None if self.tpu_worker_id is None else str(out.pop("tpu_worker_id"))
        out.pop("tpu_worker_id", None)
        out["simulate"] = out.pop("mode") == Mode.SIMULATE
        out["tpu_ids"], out["gpu_ids"] = list(self.tpu_ids), list(self.gpu_ids)
        out["chip_coords"] = None if self.chip_coords is None else list(self.chip_coords)
        return out


# Each fact of a host's place: (GKE's variable, Ray's node label, how to compare values).
_IDENTITY_SOURCES = (
    ("slice_name", C.TPU_NAME, C.LABEL_TPU_SLICE_NAME, str.strip),
    ("worker_id", C.TPU_WORKER_ID, C.LABEL_TPU_WORKER_ID, str.strip),
    ("topology", C.TPU_TOPOLOGY, C.LABEL_TPU_TOPOLOGY, lambda v: v.strip().lower()),
    ("pod_type", C.TPU_ACCELERATOR_TYPE, C.LABEL_TPU_POD_TYPE, normalize_pod_type),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostIdentity:
    """Where a host sits: its slice name, TPU worker id (unparsed), topology and
    pod type, each from GKE's variable where set, else from Ray's node label.

    `sources` names where each fact came from; `conflicts` describes each fact
    whose variable and label are both set and disagree (the variable won).
    """

    slice_name: Optional[str] = None
    worker_id: Optional[str] = None
    topology: Optional[str] = None
    pod_type: Optional[str] = None
    sources: dict = dataclasses.field(default_factory=dict)
    conflicts: tuple[str, ...] = ()


def host_identity(env: "dict[str, str]", labels: "dict[str, str]") -> HostIdentity:
    """A host's identity from its variables (`env`) and Ray's labels of its node.

    Per fact, the variable wins and the label fills in, the order in which Ray
    itself resolves each fact (``TPUAcceleratorManager``: GKE's variable, else
    the GCE metadata server, from which Ray makes the label on a TPU VM started
    with ``ray start``). The variable is also what libtpu and torch_tpu read in
    the worker. A disagreement means a label set by hand (``ray start
    --labels``) or a raylet started with other variables; it is reported in
    `conflicts` (docs/environment.md).

    Example:
        >>> i = host_identity({}, {"ray.io/tpu-slice-name": "vm-1", "ray.io/tpu-worker-id": "1",
        ...                        "ray.io/tpu-topology": "2x2x2", "ray.io/tpu-pod-type": "v4-16"})
        >>> i.slice_name, i.worker_id, i.topology, i.pod_type, i.sources["slice_name"]
        ('vm-1', '1', '2x2x2', 'v4-16', 'ray.io/tpu-slice-name')
        >>> host_identity({"TPU_NAME": "a"}, {"ray.io/tpu-slice-name": "b"}).conflicts
        ("TPU_NAME='a' but node label ray.io/tpu-slice-name='b'; TPU_NAME wins",)
    """
    values, sources, conflicts = {}, {}, []
    for field, var, label, canon in _IDENTITY_SOURCES:
        from_env, from_label = env.get(var) or None, labels.get(label) or None
        values[field] = from_env if from_env is not None else from_label
        if values[field] is not None:
            sources[field] = var if from_env is not None else label
        if from_env is not None and from_label is not None and canon(from_env) != canon(from_label):
            conflicts.append(f"{var}={from_env!r} but node label {label}={from_label!r}; {var} wins")
    return HostIdentity(**values, sources=sources, conflicts=tuple(conflicts))


def job_mode(reports: Sequence[WorkerReport]) -> Mode:
    """The one `Mode` of all workers; ValueError when some simulate and others not."""
    modes = {r.mode for r in reports}
    if len(modes) > 1:
        raise ValueError(
            f"{C.RAY_TRAIN_TPU_SIMULATE}=1 is set on some workers but not others; a "
            "slice is either simulated or real: set it on every host or on none"
        )
    return modes.pop() if modes else Mode.TPU


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What `layout` needs to rank one worker."""

    index: int  # position in Ray's worker group
    node_ip: str
    slice_name: Optional[str]  # TPU_NAME of the host
    tpu_worker_id: Optional[int]  # TPU_WORKER_ID of the host
    tpu_ids: tuple[int, ...]  # Ray's TPU accelerator ids of this worker
    node_tpus: float  # TPU resources of the worker's host
    chip_coords: Optional[Coords] = None  # physical (X, Y, Z) of its host's first chip, None if unknown

    def where(self) -> str:
        return (
            f"worker {self.index} on host {self.node_ip} (TPU_NAME={self.slice_name}, "
            f"TPU_WORKER_ID={self.tpu_worker_id})"
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    ranks: list[int]  # ranks[i] = rank of the worker at index i
    hosts: list[str]  # host addresses by node rank (slice-major, `order_slice_hosts` order)
    slice_names: list[str]  # slice names by slice id
    warnings: tuple[str, ...] = ()  # from `order_slice_hosts`, for the log
    notes: tuple[str, ...] = ()  # slices ordered by TPU_WORKER_ID for want of coordinates

    def index_of_rank(self) -> list[int]:
        """Ray worker index of each rank."""
        order = [0] * len(self.ranks)
        for index, rank in enumerate(self.ranks):
            order[rank] = index
        return order


@dataclasses.dataclass(frozen=True)
class HostOrder:
    """Where each host of one slice sits, from `order_slice_hosts`."""

    positions: dict[str, Optional[int]]  # host IP -> position in the slice (its NODE_RANK there)
    by_coords: bool  # True: physical chip coordinates; False: TPU_WORKER_ID
    warnings: tuple[str, ...] = ()  # one per host whose TPU_WORKER_ID is overruled, or why coordinates were refused
    note: Optional[str] = None  # no host reported coordinates (say so once, not per host)


def host_of_chip(chip: Sequence[int]) -> Coords:
    """The host grid coordinates of a chip, as torch_tpu's launcher computes them
    (``chip // _CHIPS_PER_HOST``, with missing fields 0).

    Example:
        >>> host_of_chip((3, 2, 5))
        (1, 1, 5)
    """
    padded = list(chip)[:3] + [0] * (3 - len(chip[:3]))
    return tuple(c // b for c, b in zip(padded, CHIPS_PER_HOST))


def order_slice_hosts(slice_name: Optional[str], claims: Sequence[tuple[str, Optional[int], Optional[Sequence[int]]]]) -> HostOrder:
    """Order the hosts of one slice from what their workers report.

    `claims` holds one ``(host IP, TPU_WORKER_ID or None, chip coordinates or
    None)`` per worker (several per host; one worker per host asks torch_tpu,
    `_worker_fns.host_chip_coords`, the others say None). When every host has
    chip coordinates and they put every host in its own place, a host's position is
    its index among the slice's hosts sorted as torch_tpu's launcher sorts them
    (``_get_slice_host_coordinates``: chip // (2, 2, 1), ``key=lambda h: h[::-1]``,
    Z-major, Y, X-minor), and each host whose TPU_WORKER_ID is missing, repeated
    or different from that position gets a warning naming its IP and both
    values. Otherwise positions are the TPU_WORKER_IDs (checked by `layout`).

    Example:
        >>> o = order_slice_hosts("s", [("10.0.0.1", 0, (0, 0, 1)), ("10.0.0.2", 1, (0, 0, 0))])
        >>> o.positions, o.by_coords
        ({'10.0.0.1': 1, '10.0.0.2': 0}, True)
        >>> print(o.warnings[1])
        host 10.0.0.1 of slice s has TPU_WORKER_ID=0, but its chip coordinates (0, 0, 1) put it at position 1 (torch_tpu's Z-major host order); it takes position 1 (NODE_RANK in the slice)
    """
    hosts: dict[str, list[tuple]] = {}
    for ip, worker_id, chip in claims:
        hosts.setdefault(ip, []).append((worker_id, None if chip is None else tuple(chip)))
    worker_ids = {ip: next((w for w, _ in cs if w is not None), None) for ip, cs in hosts.items()}

    def by_worker_id(warning: Optional[str] = None, note: Optional[str] = None) -> HostOrder:
        return HostOrder(positions=dict(worker_ids), by_coords=False,
                         warnings=(warning,) if warning else (), note=note)

    keep = "; hosts stay in TPU_WORKER_ID order"
    if len(hosts) == 1:
        return by_worker_id()  # one host: nothing to order, nothing to say
    without = sorted(ip for ip, cs in hosts.items() if all(chip is None for _, chip in cs))
    if len(without) == len(hosts):
        return by_worker_id(note=f"slice {slice_name}: no host reports TPU chip coordinates{keep}")
    if without:
        return by_worker_id(f"slice {slice_name}: host(s) {', '.join(without)} report no TPU chip coordinates "
                            f"while the others do{keep}")
    grid: dict[str, Coords] = {}
    for ip, cs in hosts.items():
        found = sorted({host_of_chip(chip) for _, chip in cs if chip is not None})
        if len(found) > 1:
            return by_worker_id(f"slice {slice_name}: the workers of host {ip} report chips of different "
                                f"hosts {found}{keep}")
        grid[ip] = found[0]
    shared = defaultdict(list)
    for ip, h in grid.items():
        shared[h].append(ip)
    clash = [(h, sorted(ips)) for h, ips in sorted(shared.items()) if len(ips) > 1]
    if clash:
        h, ips = clash[0]
        return by_worker_id(f"slice {slice_name}: chip coordinates put hosts {', '.join(ips)} in the same "
                            f"host position {h}, so they cannot order the slice{keep}")
    order = sorted(grid.values(), key=lambda h: h[::-1])
    positions = {ip: order.index(h) for ip, h in grid.items()}
    return HostOrder(positions=positions, by_coords=True, warnings=tuple(_overruled(slice_name, hosts, worker_ids, positions)))


def _overruled(slice_name, hosts: dict, worker_ids: dict, positions: dict) -> list[str]:
    counts = Counter(w for w in worker_ids.values() if w is not None)
    out = []
    for ip in sorted(positions, key=positions.get):
        worker_id, position = worker_ids[ip], positions[ip]
        if worker_id is None:
            what = "has no TPU_WORKER_ID"
        elif counts[worker_id] > 1:
            others = sorted(o for o, w in worker_ids.items() if w == worker_id and o != ip)
            what = f"has TPU_WORKER_ID={worker_id}, which host(s) {', '.join(others)} also have"
        elif worker_id != position:
            what = f"has TPU_WORKER_ID={worker_id}"
        else:
            continue
        chip = next(c for _, c in hosts[ip] if c is not None)
        out.append(f"host {ip} of slice {slice_name} {what}, but its chip coordinates {chip} put it at "
                   f"position {position} (torch_tpu's Z-major host order); it takes position {position} "
                   "(NODE_RANK in the slice)")
    return out


class LayoutError(ValueError):
    """The workers do not form whole slices of one device per worker."""


def layout(infos: Sequence[WorkerInfo], topology: Topology, num_slices: int) -> Layout:
    """Check the workers and give each its rank.

    Slices are ordered by name, hosts by `order_slice_hosts` (physical chip
    coordinates when every host reports them, else TPU worker id), devices by
    Ray's TPU accelerator id on the host (the chip index of
    ``TPU_VISIBLE_CHIPS``, or the TensorCore index on v7x).

    Raises:
        LayoutError: naming the workers and hosts at fault and the fix.
    """
    _check_one_device_each(infos)
    expected = topology.num_devices * num_slices
    if len(infos) != expected:
        raise LayoutError(
            f"{len(infos)} workers cannot fill {num_slices} x {topology}: it needs "
            f"{expected} (one per device); use TPUScalingConfig(topology=..., "
            "accelerator_type=..., num_slices=...) to size the job"
        )
    _check_slice_names(infos)
    by_slice: dict[str, list[WorkerInfo]] = defaultdict(list)
    for info in infos:
        by_slice[info.slice_name].append(info)
    if len(by_slice) != num_slices:
        names = ", ".join(sorted(map(str, by_slice)))
        raise LayoutError(
            f"workers span {len(by_slice)} TPU slice(s) ({names}) but the job asks for "
            f"{num_slices}; each slice must be whole, so check TPU_NAME on every host"
        )
    slice_names = sorted(by_slice)
    ranks = [0] * len(infos)
    hosts = [""] * (topology.num_hosts * num_slices)
    warnings: list[str] = []
    notes: list[str] = []
    for slice_id, name in enumerate(slice_names):
        members = by_slice[name]
        order = order_slice_hosts(name, [(i.node_ip, i.tpu_worker_id, i.chip_coords) for i in members])
        warnings.extend(order.warnings)
        notes.extend([order.note] if order.note else [])
        if not order.by_coords:
            _check_worker_ids(members)
        by_host: dict[int, list[WorkerInfo]] = defaultdict(list)
        for info in members:
            by_host[order.positions[info.node_ip]].append(info)
        for position, host_infos in _hosts_of_slice(by_host, topology, name, order.by_coords).items():
            hosts[slice_id * topology.num_hosts + position] = host_infos[0].node_ip
            for info in host_infos:
                ranks[info.index] = rank_of(topology, slice_id=slice_id, worker_id=position, local_rank=info.tpu_ids[0])
    return Layout(ranks=ranks, hosts=hosts, slice_names=slice_names, warnings=tuple(warnings), notes=tuple(notes))


def _check_one_device_each(infos: Sequence[WorkerInfo]) -> None:
    bad = [i for i in infos if len(i.tpu_ids) != 1]
    if bad:
        details = "; ".join(f"{i.where()} holds {len(i.tpu_ids)} TPU device(s) {list(i.tpu_ids)}" for i in bad[:4])
        raise LayoutError(
            f"ray_train_tpu runs exactly one TPU device per worker, but {details}; "
            "set resources_per_worker={'TPU': 1} (TPUScalingConfig does)"
        )


def _check_slice_names(infos: Sequence[WorkerInfo]) -> None:
    for info in infos:
        if info.slice_name is None:
            raise LayoutError(
                f"{info.where()} does not say which slice it is on: every TPU host needs TPU_NAME "
                f"(GKE's TPU webhook sets it) or Ray's {C.LABEL_TPU_SLICE_NAME} node label (Ray sets it "
                "from the GCE metadata server on a TPU VM started with `ray start`)"
            )


def _check_worker_ids(infos: Sequence[WorkerInfo]) -> None:
    """Without chip coordinates, TPU_WORKER_ID is all that orders a slice's hosts."""
    for info in infos:
        if info.tpu_worker_id is None:
            raise LayoutError(
                f"{info.where()} does not say which host of its slice it is: every TPU host needs "
                f"TPU_NAME and TPU_WORKER_ID (GKE's TPU webhook sets them) or Ray's {C.LABEL_TPU_SLICE_NAME} "
                f"and {C.LABEL_TPU_WORKER_ID} node labels (Ray sets them from the GCE metadata server "
                "on a TPU VM started with `ray start`), or every host must report its chip coordinates"
            )
    ips = defaultdict(set)
    for info in infos:
        ips[(info.slice_name, info.tpu_worker_id)].add(info.node_ip)
    for (name, worker_id), addrs in ips.items():
        if len(addrs) > 1:
            raise LayoutError(
                f"TPU_WORKER_ID={worker_id} of slice {name} is claimed by several hosts "
                f"({', '.join(sorted(addrs))}); every host of a slice needs its own id "
                "(or every host must report its chip coordinates, which then order the slice)"
            )


def _hosts_of_slice(by_host: dict[int, list[WorkerInfo]], topology: Topology, name: str,
                    by_coords: bool) -> dict[int, list[WorkerInfo]]:
    want = set(range(topology.num_hosts))
    if set(by_host) != want:
        missing = sorted(want - set(by_host))
        extra = sorted(set(by_host) - want)
        what = (f"{len(by_host)} hosts report chip coordinates" if by_coords
                else f"TPU worker ids {sorted(by_host)} have workers")
        raise LayoutError(
            f"slice {name} is not whole: {what}, "
            f"{topology} needs 0..{topology.num_hosts - 1}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    for position, host_infos in by_host.items():
        _check_host_devices(host_infos, topology, name, position)
    return by_host


def _check_host_devices(host_infos: list[WorkerInfo], topology: Topology, name: str, position: int) -> None:
    ip = host_infos[0].node_ip
    where = f"host {ip} (slice {name}, position {position}, TPU_WORKER_ID={host_infos[0].tpu_worker_id})"
    node_tpus = {i.node_tpus for i in host_infos}
    if node_tpus != {topology.devices_per_host}:
        raise LayoutError(
            f"{where} reports "
            f"{sorted(node_tpus)} TPU resources but a {topology} host has "
            f"{topology.devices_per_host}; every host of a slice must report the same "
            "chip count (check the node's TPU resource and RAY_TPU_RESOURCE_PER_CHIP)"
        )
    ids = sorted(i.tpu_ids[0] for i in host_infos)
    if ids != list(range(topology.devices_per_host)):
        raise LayoutError(
            f"{where} runs workers on TPU "
            f"ids {ids}; a {topology} host needs one worker on each of "
            f"0..{topology.devices_per_host - 1}"
        )
