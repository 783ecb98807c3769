"""A simulated TPU slice: a real multi-raylet Ray cluster on one machine.

One raylet per TPU host, each on its own loopback address, carrying the TPU
resources, node labels and host environment that a GKE TPU node has
(``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``),
so Ray's real TPU scheduling (``SlicePlacementGroup``, head resources, labels)
runs unchanged. Simulation is explicit: every process of the cluster carries
``RAY_TRAIN_TPU_SIMULATE=1``, which is what lets the backend use CPU tensors
and gloo. Every process also carries ``TPU_SKIP_MDS_QUERY=1`` and
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so libtpu never looks for a cloud metadata
server and torch never autoloads torch_tpu.

Example:
    >>> from ray_train_tpu.testing import simulated_tpu_cluster
    >>> with simulated_tpu_cluster("2x2x2", "TPU-V4") as sim:   # doctest: +SKIP
    ...     print(sim.hosts)                                       # doctest: +SKIP
    {(0, 0): '127.0.1.1', (0, 1): '127.0.1.2'}
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator, Mapping, Optional, Sequence

from ray_train_tpu import _environ
from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)

# Ray rewrites 127.0.0.1 and "localhost" to the machine's routable address, so
# the head and the hosts use other loopback addresses.
HEAD_IP = "127.0.0.100"
_OBJECT_STORE_BYTES = 80 * 2**20
# Hosts one machine can simulate: each is a raylet (plus its workers).
MAX_SIMULATED_HOSTS = 64

# What every process of a simulated cluster carries, driver included.
SIMULATION_ENV = C.SIMULATION_ENV

HostKey = tuple[int, int]  # (slice id, TPU worker id)


def host_ip(slice_id: int, worker_id: int) -> str:
    """Loopback address of a simulated host: ``127.0.<slice id + 1>.<worker id + 1>``."""
    return f"127.0.{slice_id + 1}.{worker_id + 1}"


def slice_name(slice_id: int) -> str:
    return f"sim-slice-{slice_id}"


@dataclasses.dataclass
class SimulatedTPUCluster:
    """A running simulated cluster; yielded by `simulated_tpu_cluster`."""

    topology: Topology
    num_slices: int
    address: str
    hosts: dict[HostKey, str]  # (slice id, worker id) -> IP of the hosts that joined
    cluster: "object"  # ray.cluster_utils.Cluster
    _nodes: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def slice_names(self) -> list[str]:
        return [slice_name(s) for s in range(self.num_slices)]

    def host_env(self, key: HostKey) -> dict[str, str]:
        return _host_env(self.topology, *key)

    def remove_host(self, slice_id: int, worker_id: int) -> None:
        """Take a host away, as a preempted or failed TPU VM (for fault tests)."""
        node = self._nodes.pop((slice_id, worker_id))
        self.hosts.pop((slice_id, worker_id))
        self.cluster.remove_node(node, allow_graceful=False)

    def add_host(
        self,
        slice_id: int,
        worker_id: int,
        *,
        stall_s: Optional[float] = None,
        topology: Optional[Topology] = None,
        env: Optional[Mapping[str, Optional[str]]] = None,
        labels: Optional[Mapping[str, Optional[str]]] = None,
        resources: Optional[Mapping[str, Optional[float]]] = None,
    ) -> None:
        """(Re)start a host, e.g. after `remove_host`. With `stall_s`, its workers
        wait that long before joining the process group (a host that never joins).

        The other keywords inject faults (see ``tests/distributed/test_doctor.py``):

        - `topology`: the host's slice, when it is not the cluster's (e.g. a v7x
          host next to v4 slices).
        - `env`: host variables over the usual ``TPU_*`` ones; ``None`` removes
          one. Ray derives the node's labels, and adds its slice-name and
          ``TPU-<pod type>-head`` resources, from them.
        - `labels`: node labels over the usual ones (``None`` removes one), as
          ``ray start --labels`` overrides what Ray derives.
        - `resources`: node resources over the usual ones (``None`` removes one),
          e.g. ``{"TPU": 3}``. To drop the head resource, also give `env` a
          ``TPU_WORKER_ID`` other than 0, or Ray adds it back.
        """
        key = (slice_id, worker_id)
        extra = {C.RAY_TRAIN_TPU_SIMULATE_STALL_S: str(stall_s)} if stall_s else None
        self._nodes[key] = _add_host(
            self.cluster, topology or self.topology, slice_id, worker_id, self._cpus, extra,
            env=env, labels=labels, resources=resources,
        )
        self.hosts[key] = host_ip(slice_id, worker_id)

    _cpus: int = 0


def _host_env(topology: Topology, slice_id: int, worker_id: int) -> dict[str, str]:
    env = {
        C.TPU_NAME: slice_name(slice_id),
        C.TPU_WORKER_ID: str(worker_id),
        C.TPU_ACCELERATOR_TYPE: topology.pod_type,
        C.TPU_TOPOLOGY: topology.name,
    }
    if topology.devices_per_chip > 1:
        env[C.RAY_TPU_RESOURCE_PER_CHIP] = str(topology.devices_per_chip)
    return env


def _overlay(base: Mapping, overrides: Optional[Mapping]) -> dict:
    """`base` updated with `overrides`; a ``None`` value removes the key."""
    out = {**base, **(overrides or {})}
    return {k: v for k, v in out.items() if v is not None}


def _add_host(cluster, topology: Topology, slice_id: int, worker_id: int, cpus: int, extra_env=None,
              *, env=None, labels=None, resources=None):
    """Start one host's raylet. `extra_env` goes to the raylet only; `env`,
    `labels` and `resources` override the host's usual ones (see `add_host`)."""
    removed = [k for k, v in (env or {}).items() if v is None]
    env = _overlay(_host_env(topology, slice_id, worker_id), env)
    name = slice_name(slice_id)
    node_resources = {
        "TPU": topology.devices_per_host,
        f"accelerator_type:{topology.accelerator_type}": 1,
        name: 1,
    }
    if worker_id == 0:
        node_resources[f"TPU-{topology.pod_type}-head"] = 1
    node_labels = {
        C.LABEL_TPU_SLICE_NAME: name,
        C.LABEL_TPU_WORKER_ID: str(worker_id),
        C.LABEL_TPU_POD_TYPE: topology.pod_type,
        C.LABEL_TPU_TOPOLOGY: topology.name,
        C.LABEL_ACCELERATOR_TYPE: topology.accelerator_type,
    }
    # Ray resolves a node's TPU labels in this process from these variables, so
    # they are set here while the node is added, and in the raylet's env.
    saved = _environ.snapshot(list(env) + removed)
    _environ.update(env)
    _environ.unset(removed)
    try:
        return cluster.add_node(
            node_ip_address=host_ip(slice_id, worker_id),
            num_cpus=cpus,
            resources=_overlay(node_resources, resources),
            labels=_overlay(node_labels, labels),
            env_vars={**SIMULATION_ENV, **env, **(extra_env or {})},
            object_store_memory=_OBJECT_STORE_BYTES,
        )
    finally:
        _environ.unset(k for k in env if k not in saved)
        _environ.update(saved)


def _coords_env(key, coords, keys) -> dict[str, str]:
    if tuple(key) not in keys:
        raise ValueError(f"host_coords key {key!r} is not a (slice id, worker id) of a started host")
    values = list(coords) if isinstance(coords, (list, tuple)) else None
    if values is None or len(values) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                     for v in values):
        raise ValueError(
            f"host_coords[{tuple(key)!r}] = {coords!r} must be the chip coordinates (x, y, z) of the "
            "host's first chip: three non-negative integers, e.g. (0, 0, 2)"
        )
    return {C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS: ",".join(str(v) for v in values)}


def _registration_order(topology: Topology, num_slices: int, host_order, missing) -> list[HostKey]:
    order = list(range(topology.num_hosts)) if host_order is None else list(host_order)
    if sorted(order) != list(range(topology.num_hosts)):
        raise ValueError(
            f"host_order {host_order!r} must be a permutation of the TPU worker ids "
            f"0..{topology.num_hosts - 1} of {topology}"
        )
    keys = [(s, w) for s in range(num_slices) for w in order]
    for key in missing:
        if key not in keys:
            raise ValueError(
                f"missing_hosts entry {key!r} is not a (slice id, worker id) of "
                f"{num_slices} x {topology}"
            )
    return [k for k in keys if k not in set(missing)]


@contextlib.contextmanager
def simulated_tpu_cluster(
    topology: str = "2x2x2",
    accelerator_type: str = "TPU-V4",
    num_slices: int = 1,
    *,
    host_order: Optional[Sequence[int]] = None,
    missing_hosts: Sequence[HostKey] = (),
    stalled_hosts: Sequence[HostKey] = (),
    host_env: Optional[Mapping[HostKey, Mapping[str, str]]] = None,
    host_coords: Optional[Mapping[HostKey, Sequence[int]]] = None,
    cpus_per_host: Optional[int] = None,
    connect: bool = True,
) -> Iterator[SimulatedTPUCluster]:
    """Start a simulated TPU cluster, connect to it, and tear it all down on exit.

    Args:
        topology, accelerator_type: the slice, e.g. ``"2x2x2"`` and ``"TPU-V4"``.
        num_slices: identical slices, named ``sim-slice-<i>``.
        host_order: the order in which each slice's hosts register with Ray, as
            TPU worker ids (default ascending); ranks must not depend on it.
        missing_hosts: ``(slice id, worker id)`` of hosts that never start.
        stalled_hosts: ``(slice id, worker id)`` of hosts whose workers start but
            never join the process group (they wait an hour first).
        host_env: extra variables for the raylets (and so the workers) of some
            hosts, by ``(slice id, worker id)``: fault injection, e.g. the
            ``RAY_TRAIN_TPU_SIMULATE_*`` knobs of `ray_train_tpu.doctor`.
        host_coords: physical chip coordinates ``(x, y, z)`` of the first chip
            of some hosts, by ``(slice id, worker id)``, as a real host reads
            them from torch_tpu. Give every host of a slice coordinates and they
            order its hosts (torch_tpu's Z-major order), whatever their
            ``TPU_WORKER_ID`` (which `host_env` may shuffle or repeat); without
            them, hosts keep TPU worker id order.
        cpus_per_host: logical CPUs per host; default chips + 1, because each of
            Ray Train's TPU bundles also asks for one CPU.
        connect: ``ray.init`` the driver to the cluster (default True).
    """
    import ray
    from ray.cluster_utils import Cluster

    from ray_train_tpu._compat import ray_train as compat_ray

    topo = Topology.parse(topology, accelerator_type)
    V.check_num_slices("simulated_tpu_cluster", num_slices)
    V.check_int("simulated_tpu_cluster", "num_slices * hosts per slice", num_slices * topo.num_hosts,
                max=MAX_SIMULATED_HOSTS, why="each simulated host is a raylet process of ~150 MB",
                fix=f"simulate a smaller topology or fewer slices than {topo} x {num_slices}")
    if cpus_per_host is not None:
        V.check_int("simulated_tpu_cluster", "cpus_per_host", cpus_per_host, min=1, max=1024)
    keys = _registration_order(topo, num_slices, host_order, [tuple(k) for k in missing_hosts])
    host_env = {tuple(k): v for k, v in (host_env or {}).items()}
    for key in host_env:
        if key not in keys:
            raise ValueError(f"host_env key {key!r} is not a (slice id, worker id) of a started host")
    for key, coords in (host_coords or {}).items():
        host_env[tuple(key)] = {**host_env.get(tuple(key), {}), **_coords_env(key, coords, keys)}
    cpus = cpus_per_host if cpus_per_host is not None else topo.devices_per_host + 1
    driver_env = dict(SIMULATION_ENV)
    if topo.devices_per_chip > 1:
        driver_env[C.RAY_TPU_RESOURCE_PER_CHIP] = str(topo.devices_per_chip)
    saved = _environ.snapshot(driver_env)
    if ray.is_initialized():
        raise RuntimeError(
            "simulated_tpu_cluster: Ray is already initialized in this process; "
            "call ray.shutdown() first"
        )
    _environ.update(driver_env)
    undo_metadata_guard = compat_ray.forbid_metadata_server()
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                node_ip_address=HEAD_IP,
                num_cpus=1,
                # Ray Train's PlacementGroupCleaner asks the state API (served by
                # the dashboard) whether the controller lives: without it, no
                # safety net and a warning every second.
                include_dashboard=True,
                dashboard_port=0,
                object_store_memory=_OBJECT_STORE_BYTES,
                env_vars=dict(driver_env),
            ),
        )
        sim = SimulatedTPUCluster(
            topology=topo, num_slices=num_slices, address=cluster.address, hosts={}, cluster=cluster
        )
        sim._cpus = cpus
        stalled = {tuple(k) for k in stalled_hosts}
        for slice_id, worker_id in keys:
            sim.add_host(
                slice_id, worker_id,
                stall_s=3600 if (slice_id, worker_id) in stalled else None,
                env=host_env.get((slice_id, worker_id)),
            )
        cluster.wait_for_nodes(timeout=60)
        if connect:
            ray.init(
                address=cluster.address,
                _node_ip_address=HEAD_IP,
                # RAY_ADDRESS: Ray Train's own helpers (PlacementGroupCleaner)
                # call ray.init() without an address and would otherwise join
                # whichever cluster on this machine started last.
                runtime_env={"env_vars": {**driver_env, C.RAY_ADDRESS: cluster.address}},
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
        logger.info("simulated %d x %s: %d hosts up", num_slices, topo, len(sim.hosts))
        yield sim
    finally:
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            undo_metadata_guard()
            _environ.unset(k for k in driver_env if k not in saved)
            _environ.update(saved)
