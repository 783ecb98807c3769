"""The complete TorchTPU environment of every worker of a job: a pure function.

No Ray, no I/O, no ``os.environ``: `plan`, the Ray Train backend and the tests
all call `launch_env` / `launch_envs`, so they cannot drift apart.

Conventions are torch_tpu's own launcher's (``set_tpu_launch_env`` in
``torch_tpu/_internal/distributed/distributed.py``):

- ``TORCH_TPU_SLICEBUILDER_ADDRESSES``: ``host:BASE+i`` for every host of the
  slice in TPU worker id order and i in 0..devices_per_host-1, BASE =
  ``TORCH_TPU_BASE_PORT`` (8070). The same list on every rank of the slice, so
  ``addresses[rank within slice]`` is the rank's own host at BASE+LOCAL_RANK.
  (On one host torch_tpu picks ``localhost:<free port>``; we use the host
  address and BASE there too, so that every rank derives the list alone.)
- ``NNODES`` = hosts, ``MASTER_ADDR`` = the first host, ``MASTER_PORT`` = 29500,
  ``NODE_RANK`` = the host's TPU worker id (hosts sorted Z-major, Y, X-minor).
- ``TORCH_TPU_TOPOLOGY`` = the whole slice's mesh bounds (``"4,4,1"``).
- Unlike the launcher, a value the host already carries is replaced (`reconcile`):
  a Ray job's hosts may carry another slice's or job's values.

libtpu's per-process view (`process_view_env`) is torch_tpu's: at PJRT start
torch_tpu 0.2.0 (``InitializeDistributedEnvironment`` in its native library)
overwrites ``TPU_VISIBLE_CHIPS`` with ``LOCAL_RANK``, ``TPU_HOST_BOUNDS`` and
``TPU_PROCESS_BOUNDS`` with ``TORCH_TPU_TOPOLOGY``, and the chips per host and
per process with one chip (``"1,1,1"``; ``"1,1,1,1"`` on v7x, one TensorCore).
Ray 2.60 sets one-chip, single-host bounds for a ``{"TPU": 1}`` worker
(``TPUAcceleratorManager.set_current_process_visible_accelerator_ids``) and
GKE the whole host's; we set torch_tpu's values before anything runs, so that
a process that reads them before PJRT starts sees the slice it is part of,
not a one-chip slice (docs/environment.md).

Across slices (``num_slices > 1``) ranks are slice-major; each slice keeps its
own slice-builder addresses and worker hostnames (ICI stays inside a slice),
``NODE_RANK``/``NNODES`` count hosts across the job, and libtpu's MegaScale
variables connect the slices over DCN the way Ray sets them
(``ray.util.tpu.get_tpu_coordinator_env_vars``): the coordinator is
``MASTER_ADDR:MEGASCALE_PORT`` (8080) and each process listens on
``MEGASCALE_PORT + 2 * LOCAL_RANK`` with its debug port next to it, the values
torch_tpu itself sets at PJRT start (`constants.DEFAULT_MEGASCALE_PORT`).

Example:
    >>> from ray_train_tpu.topology import Topology
    >>> t = Topology.parse("2x2x2", "TPU-V4")
    >>> env = launch_env(t, ["10.0.0.1", "10.0.0.2"], rank=5, xprof_session_id="1")
    >>> env["NODE_RANK"], env["LOCAL_RANK"], env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[5]
    ('1', '1', '10.0.0.2:8071')
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.topology import Coords, Topology

# Every variable `launch_env` sets, in the order people read them.
ENV_KEYS: tuple[str, ...] = (
    C.RANK,
    C.WORLD_SIZE,
    C.LOCAL_RANK,
    C.LOCAL_WORLD_SIZE,
    C.NODE_RANK,
    C.NNODES,
    C.MASTER_ADDR,
    C.MASTER_PORT,
    C.TPU_VISIBLE_CHIPS,
    C.TPU_HOST_BOUNDS,
    C.TPU_CHIPS_PER_HOST_BOUNDS,
    C.TPU_PROCESS_BOUNDS,
    C.TPU_CHIPS_PER_PROCESS_BOUNDS,
    C.TPU_WORKER_ID,
    C.TPU_WORKER_HOSTNAMES,
    C.TORCH_TPU_SLICEBUILDER_ADDRESSES,
    C.TORCH_TPU_TOPOLOGY,
    C.TORCH_TPU_XPROF_SESSION_ID,
)
# What the platform sets on every TPU worker by design and ours replace without
# a warning (docs/environment.md): Ray's one-chip mask and bounds, GKE's whole-host
# bounds, GKE's and KubeRay's worker id (`discovery.order_slice_hosts` names a host
# whose id disagrees with its chips) and hostnames ("localhost" on one host, DNS
# names on KubeRay, where ours are the hosts' addresses).
PLATFORM_KEYS: tuple[str, ...] = (
    C.TPU_VISIBLE_CHIPS,
    C.TPU_HOST_BOUNDS,
    C.TPU_CHIPS_PER_HOST_BOUNDS,
    C.TPU_WORKER_ID,
    C.TPU_WORKER_HOSTNAMES,
)
# Set per process by torch_tpu at PJRT start, or describing one process: a
# child process that must see the whole host (`coords_query_env`) gets none of them.
PROCESS_KEYS: tuple[str, ...] = (
    C.RANK, C.WORLD_SIZE, C.LOCAL_RANK, C.LOCAL_WORLD_SIZE, C.TPU_VISIBLE_CHIPS, C.TPU_VISIBLE_DEVICES,
    C.TPU_PROCESS_BOUNDS, C.TPU_CHIPS_PER_PROCESS_BOUNDS, C.CLOUD_TPU_TASK_ID, C.TPU_PROCESS_ADDRESSES,
    C.TPU_PROCESS_PORT,
)
MEGASCALE_KEYS: tuple[str, ...] = (
    C.MEGASCALE_COORDINATOR_ADDRESS,
    C.MEGASCALE_NUM_SLICES,
    C.MEGASCALE_SLICE_ID,
    C.MEGASCALE_PORT,
    C.MEGASCALE_DEBUG_PORT,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerPlace:
    """Where one rank sits in the job."""

    rank: int
    slice_id: int
    worker_id: int  # TPU worker id of the host, within its slice
    local_rank: int  # TorchTPU device index on the host
    node_rank: int  # host index across the job: slice_id * num_hosts + worker_id
    chip: int  # chip index on the host, as in TPU_VISIBLE_CHIPS
    chip_coords: Coords  # chip coordinates within the slice's mesh


def worker_place(topology: Topology, rank: int, num_slices: int = 1) -> WorkerPlace:
    """The place of `rank`: ranks are slice-major, then host (TPU worker id),
    then device on the host."""
    V.check_num_slices("", num_slices)
    world_size = topology.num_devices * num_slices
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank!r} is outside the job's {world_size} workers "
            f"({num_slices} x {topology}); valid: 0..{world_size - 1}"
        )
    slice_id, in_slice = divmod(rank, topology.num_devices)
    worker_id, local_rank = divmod(in_slice, topology.devices_per_host)
    chip = local_rank // topology.devices_per_chip
    return WorkerPlace(
        rank=rank,
        slice_id=slice_id,
        worker_id=worker_id,
        local_rank=local_rank,
        node_rank=slice_id * topology.num_hosts + worker_id,
        chip=chip,
        chip_coords=topology.chip_coords(worker_id, chip),
    )


def process_view_env(topology: Topology, local_rank: int) -> dict[str, str]:
    """libtpu's view for the process of device `local_rank` on its host, as
    torch_tpu 0.2.0 sets it at PJRT start: the slice's mesh of one-chip processes.

    Example:
        >>> process_view_env(Topology.parse("2x2x2", "TPU-V4"), 5)["TPU_HOST_BOUNDS"]
        '2,2,2'
        >>> process_view_env(Topology.parse("2x2x1", "TPU-V7X"), 5)["TPU_CHIPS_PER_PROCESS_BOUNDS"]
        '1,1,1,1'
    """
    one = "1,1,1,1" if topology.devices_per_chip > 1 else "1,1,1"
    mesh = topology.torch_tpu_topology
    return {
        C.TPU_VISIBLE_CHIPS: str(local_rank),
        C.TPU_HOST_BOUNDS: mesh,
        C.TPU_CHIPS_PER_HOST_BOUNDS: one,
        C.TPU_PROCESS_BOUNDS: mesh,
        C.TPU_CHIPS_PER_PROCESS_BOUNDS: one,
    }


def host_view_env(topology: Topology) -> dict[str, str]:
    """libtpu's view for one process that owns a whole host, as GKE's TPU
    device plugin sets it: the slice's grid of hosts and the chips of one host.

    Example:
        >>> host_view_env(Topology.parse("2x2x4", "TPU-V4"))
        {'TPU_HOST_BOUNDS': '1,1,4', 'TPU_CHIPS_PER_HOST_BOUNDS': '2,2,1'}
    """
    grid = (b // h for b, h in zip(topology.bounds, topology.host_bounds))
    return {
        C.TPU_HOST_BOUNDS: ",".join(str(g) for g in grid),
        C.TPU_CHIPS_PER_HOST_BOUNDS: ",".join(str(h) for h in topology.host_bounds),
    }


def coords_query_env(worker_env: Mapping[str, str], topology: Topology) -> dict[str, str]:
    """The environment of torch_tpu's chip-coordinate child, started by one
    worker of a host for the whole host: the worker's, without what describes
    one process (Ray's one-chip mask, a rank: torch_tpu would start a
    multi-process client), with the whole host's view (`host_view_env`).

    Example:
        >>> env = coords_query_env({"TPU_VISIBLE_CHIPS": "2", "TPU_HOST_BOUNDS": "1,1,1", "PATH": "/bin"},
        ...                        Topology.parse("2x2x2", "TPU-V4"))
        >>> env == {"PATH": "/bin", "TPU_HOST_BOUNDS": "1,1,2", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}
        True
    """
    env = {k: v for k, v in worker_env.items() if k not in PROCESS_KEYS}
    env.update(host_view_env(topology))
    return env


def rank_of(topology: Topology, *, slice_id: int, worker_id: int, local_rank: int) -> int:
    """Inverse of `worker_place`: the rank of a device given where it sits."""
    return (slice_id * topology.num_hosts + worker_id) * topology.devices_per_host + local_rank


def placeholder_hosts(topology: Topology, num_slices: int = 1) -> list[str]:
    """Host names for a plan made before the hosts are known."""
    return [
        f"{topology.pod_type}-s{s}-w{w}"
        for s in range(num_slices)
        for w in range(topology.num_hosts)
    ]


@dataclasses.dataclass(frozen=True)
class _SliceShared:
    """The values every rank of one slice shares, computed once per slice."""

    hostnames: str
    addresses: str


class _JobShared:
    """Values shared across the job; per-slice strings are built lazily once."""

    def __init__(
        self,
        topology: Topology,
        hosts: Sequence[str],
        num_slices: int,
        base_port: int,
        master_port: int,
        megascale_port: int,
        xprof_session_id: str,
    ):
        V.check_num_slices("", num_slices)
        self.topology = topology
        self.num_slices = num_slices
        self.hosts = check_hosts(topology, hosts, num_slices)
        self.base_port = V.check_port("", "base_port", base_port, span=topology.devices_per_host)
        self.master_port = V.check_port("", "master_port", master_port)
        self.megascale_port = V.check_port("", "megascale_port", megascale_port,
                                           span=C.MEGASCALE_PORTS_PER_DEVICE * topology.devices_per_host)
        if not isinstance(xprof_session_id, str) or not xprof_session_id:
            raise ValueError(
                f"xprof_session_id must be a non-empty string shared by all ranks, "
                f"got {xprof_session_id!r}; e.g. str(time.time_ns())"
            )
        self.xprof_session_id = xprof_session_id
        self._slices: dict[int, _SliceShared] = {}

    def slice(self, slice_id: int) -> _SliceShared:
        if slice_id not in self._slices:
            n = self.topology.num_hosts
            hosts = self.hosts[slice_id * n : (slice_id + 1) * n]
            ports = [str(self.base_port + i) for i in range(self.topology.devices_per_host)]
            self._slices[slice_id] = _SliceShared(
                hostnames=",".join(hosts),
                addresses=",".join(f"{h}:{p}" for h in hosts for p in ports),
            )
        return self._slices[slice_id]

    def env(self, place: WorkerPlace) -> dict[str, str]:
        t = self.topology
        shared = self.slice(place.slice_id)
        master_addr = self.hosts[0]
        env = {
            C.RANK: str(place.rank),
            C.WORLD_SIZE: str(t.num_devices * self.num_slices),
            C.LOCAL_RANK: str(place.local_rank),
            C.LOCAL_WORLD_SIZE: str(t.devices_per_host),
            C.NODE_RANK: str(place.node_rank),
            C.NNODES: str(t.num_hosts * self.num_slices),
            C.MASTER_ADDR: master_addr,
            C.MASTER_PORT: str(self.master_port),
            **process_view_env(t, place.local_rank),
            C.TPU_WORKER_ID: str(place.worker_id),
            C.TPU_WORKER_HOSTNAMES: shared.hostnames,
            C.TORCH_TPU_SLICEBUILDER_ADDRESSES: shared.addresses,
            C.TORCH_TPU_TOPOLOGY: t.torch_tpu_topology,
            C.TORCH_TPU_XPROF_SESSION_ID: self.xprof_session_id,
        }
        if self.num_slices > 1:
            env[C.MEGASCALE_COORDINATOR_ADDRESS] = f"{master_addr}:{self.megascale_port}"
            env[C.MEGASCALE_NUM_SLICES] = str(self.num_slices)
            env[C.MEGASCALE_SLICE_ID] = str(place.slice_id)
            port = self.megascale_port + C.MEGASCALE_PORTS_PER_DEVICE * place.local_rank
            env[C.MEGASCALE_PORT] = str(port)
            env[C.MEGASCALE_DEBUG_PORT] = str(port + 1)
        return env


def launch_env(
    topology: Topology,
    hosts: Sequence[str],
    *,
    rank: int,
    num_slices: int = 1,
    xprof_session_id: str,
    base_port: int = C.DEFAULT_TORCH_TPU_BASE_PORT,
    master_port: int = C.DEFAULT_MASTER_PORT,
    megascale_port: int = C.DEFAULT_MEGASCALE_PORT,
) -> dict[str, str]:
    """The environment of one worker.

    Args:
        topology: the slice (every slice of the job has this topology).
        hosts: every host of the job in TPU worker id order, slice-major
            (``num_slices * topology.num_hosts`` names or IP addresses).
        rank: the worker's global rank (see `worker_place`).
        num_slices: slices in the job.
        xprof_session_id: profiling session id, the same on every rank.
        base_port: first slice-builder port on each host (``TORCH_TPU_BASE_PORT``).
        master_port: torch.distributed rendezvous port on the first host.
        megascale_port: MegaScale coordinator port (multi-slice only).

    Returns:
        A new dict from variable name to value, `ENV_KEYS` (and `MEGASCALE_KEYS`
        when ``num_slices > 1``).
    """
    shared = _JobShared(topology, hosts, num_slices, base_port, master_port, megascale_port, xprof_session_id)
    return shared.env(worker_place(topology, rank, num_slices))


def launch_envs(
    topology: Topology,
    hosts: Sequence[str],
    *,
    num_slices: int = 1,
    xprof_session_id: str,
    base_port: int = C.DEFAULT_TORCH_TPU_BASE_PORT,
    master_port: int = C.DEFAULT_MASTER_PORT,
    megascale_port: int = C.DEFAULT_MEGASCALE_PORT,
) -> list[tuple[WorkerPlace, dict[str, str]]]:
    """`launch_env` for every rank, in rank order; shared strings are built once
    per slice, so the cost is linear in the number of workers."""
    shared = _JobShared(topology, hosts, num_slices, base_port, master_port, megascale_port, xprof_session_id)
    places = [worker_place(topology, r, num_slices) for r in range(topology.num_devices * num_slices)]
    return [(p, shared.env(p)) for p in places]


# Everything that describes the live job. Recomputed from the live worker group on
# every attempt: a value the host already carries (a GKE webhook's, a JAX launcher's,
# one left from an earlier slice or job) is replaced, and a job variable we do not set
# (MEGASCALE_* on one slice) is removed.
JOB_KEYS: tuple[str, ...] = ENV_KEYS + MEGASCALE_KEYS


@dataclasses.dataclass(frozen=True)
class EnvPlan:
    """What one worker's environment becomes (`reconcile`)."""

    env: dict  # variables to set
    unset: tuple  # job variables the host carries that this job must not see
    replaced: dict  # name -> (host's value, ours): a stale or foreign value (not `PLATFORM_KEYS`)
    overridden: dict  # name -> (extra_env's value, ours): the user's explicit override


def reconcile(computed: Mapping[str, str], preset: Mapping[str, str], extra: Mapping[str, str],
              *, fixed: Sequence[str] = ()) -> EnvPlan:
    """One worker's environment: `computed` (from `launch_env`) wins over what the
    host carries (`preset`); only ``TPUTorchConfig(extra_env=...)`` overrides it,
    except for the `fixed` names (the ranks, which Ray decides).

    Unlike torch_tpu's launcher, which never overwrites a set variable, a Ray job
    runs on whatever hosts its placement group got, so values on the host are
    at best equal to ours and at worst another slice's (torch_tpu's "Expected 8,
    got 2" slice-builder error, a multi-slice hang).

    Example:
        >>> p = reconcile({"MASTER_ADDR": "10.0.0.1"}, {"MASTER_ADDR": "old", "MEGASCALE_PORT": "8081"}, {})
        >>> p.env, p.unset, p.replaced
        ({'MASTER_ADDR': '10.0.0.1'}, ('MEGASCALE_PORT',), {'MASTER_ADDR': ('old', '10.0.0.1')})
    """
    env = dict(computed)
    replaced = {k: (preset[k], v) for k, v in computed.items()
                if k in preset and preset[k] != v and k not in PLATFORM_KEYS}
    overridden = {}
    for key, value in extra.items():
        if key in fixed:
            continue
        if key in computed and computed[key] != value:
            overridden[key] = (value, computed[key])
        env[key] = value
    unset = tuple(k for k in JOB_KEYS if k in preset and k not in env)
    return EnvPlan(env=env, unset=unset, replaced=replaced, overridden=overridden)


def check_override(env: Mapping[str, str], place: WorkerPlace, topology: Topology, host: str,
                   num_slices: int) -> None:
    """Refuse an ``extra_env`` override that cannot describe this worker's slice:
    an address list of the wrong length or without this worker's host at its
    rank, a hostname list of the wrong length, another slice size or slice count."""
    def fail(key: str, rule: str) -> None:
        value = env[key]
        shown = value if len(value) <= 200 else value[:200] + "..."
        raise ValueError(
            f"TPUTorchConfig(extra_env) {key}={shown!r} {rule} (rank {place.rank} on host {host}, "
            f"{num_slices} x {topology}); fix or remove it from extra_env: the computed value "
            "describes the live slice"
        )

    hostnames = env.get(C.TPU_WORKER_HOSTNAMES, "").split(",")
    if C.TPU_WORKER_HOSTNAMES in env and len(hostnames) != topology.num_hosts:
        fail(C.TPU_WORKER_HOSTNAMES, f"must list the slice's {topology.num_hosts} hosts")
    if C.TORCH_TPU_SLICEBUILDER_ADDRESSES in env:
        addresses = env[C.TORCH_TPU_SLICEBUILDER_ADDRESSES].split(",")
        if len(addresses) != topology.num_devices:
            fail(C.TORCH_TPU_SLICEBUILDER_ADDRESSES, f"must have one address per device: {topology.num_devices}")
        index = place.rank - place.slice_id * topology.num_devices
        own_host, _, port = addresses[index].rpartition(":")
        if not port.isdigit() or own_host not in (host, hostnames[place.worker_id] if len(hostnames) > place.worker_id else None):
            fail(C.TORCH_TPU_SLICEBUILDER_ADDRESSES,
                 f"must have this worker's host:port at index {index}, found {addresses[index]!r}")
    if C.TORCH_TPU_TOPOLOGY in env:
        try:
            bounds = [int(b) for b in env[C.TORCH_TPU_TOPOLOGY].replace("x", ",").split(",")]
        except ValueError:
            bounds = []
        chips = 1
        for b in bounds[:3]:
            chips *= b
        if not bounds or chips != topology.num_chips:
            fail(C.TORCH_TPU_TOPOLOGY, f"must be the mesh of a {topology.num_chips}-chip slice")
    for key, want in ((C.MEGASCALE_NUM_SLICES, num_slices), (C.MEGASCALE_SLICE_ID, place.slice_id)):
        if key in env and env[key] != str(want):
            fail(key, f"must be {want}")


def check_hosts(topology: Topology, hosts: Sequence[str], num_slices: int) -> list[str]:
    expected = topology.num_hosts * num_slices
    if isinstance(hosts, str) or not isinstance(hosts, Sequence) or len(hosts) != expected:
        got = f"{len(hosts)} hosts" if isinstance(hosts, Sequence) and not isinstance(hosts, str) else hosts
        raise ValueError(
            f"hosts must list the {expected} hosts of {num_slices} x {topology} "
            f"in TPU worker id order (slice-major), got {got!r}"
        )
    hosts = list(hosts)
    for host in hosts:
        if not isinstance(host, str) or not host or len(host) > 253 or any(c in host for c in ",: \t\n"):
            raise ValueError(
                f"host {host!r} is not a host name or IPv4 address; names must be "
                "non-empty, at most 253 characters, and contain no ',', ':' or whitespace (they are joined "
                "into TORCH_TPU_SLICEBUILDER_ADDRESSES as host:port)"
            )
    if len(set(hosts)) != len(hosts):
        dupes = sorted({h for h in hosts if hosts.count(h) > 1})
        raise ValueError(
            f"hosts must be distinct, one per TPU host; repeated: {', '.join(dupes)}"
        )
    return hosts
