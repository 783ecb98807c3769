"""A simulated TPU slice: a real multi-raylet Ray cluster on one machine.

One raylet per TPU host, each on its own loopback address, carrying the TPU
resources, node labels and host environment that a KubeRay worker pod on a GKE
TPU node has (`gke_device_plugin_env`: ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``,
``TPU_HOST_BOUNDS``, ``TPU_CHIPS_PER_HOST_BOUNDS`` and the rest; KubeRay's
webhook: ``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``), so Ray's
real TPU scheduling (``SlicePlacementGroup``, head resources, labels) runs
unchanged and Ray's own code gives each ``{"TPU": 1}`` worker its one-chip
``TPU_VISIBLE_CHIPS`` and bounds from them. Each host also carries its chips'
physical coordinates (`chip_layout`), from which
`ray_train_tpu.testing.simulated_libtpu` answers torch_tpu's coordinate query
as libtpu would for the environment it runs with. Simulation is explicit: every process of the cluster carries
``RAY_TRAIN_TPU_SIMULATE=1``, which is what lets the backend use CPU tensors
and gloo. Every process also carries ``TPU_SKIP_MDS_QUERY=1`` and
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so libtpu never looks for a cloud metadata
server and torch never autoloads torch_tpu.

Hosts do not share a disk. Each host has a directory of its own that stands for
its local filesystem (`SimulatedTPUCluster.host_root`): its ``TMPDIR`` (so
``tempfile.gettempdir()`` in its workers) is in it, and so is the driver's while
the cluster is up (the driver is on the head host). A path on one host's disk is
not on another's (`host_sees`, which ray_train_tpu's own checks of model and
checkpoint directories apply), so a driver-local temporary directory fails here
as on a real cluster. Storage every host sees, as a shared mount (NFS, GCS FUSE)
or a bucket is on a real cluster, is `SimulatedTPUCluster.storage_path`.

Example:
    >>> from ray_train_tpu.testing import simulated_tpu_cluster
    >>> with simulated_tpu_cluster("2x2x2", "TPU-V4") as sim:   # doctest: +SKIP
    ...     print(sim.hosts)                                       # doctest: +SKIP
    {(0, 0): '127.0.1.1', (0, 1): '127.0.1.2'}
    >>> host_sees("/tmp/rtt-sim-x/hosts/127.0.1.2/tmp/ckpt", "/tmp/rtt-sim-x/hosts/127.0.1.1")
    False
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Iterator, Mapping, Optional, Sequence, Union

from ray_train_tpu import _environ
from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.testing.worker_env import in_scope
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

# Run in every worker of a cluster of TPU VMs: Ray's metadata queries answered per host.
_METADATA_HOOK = "ray_train_tpu._compat.ray_tpu.install_simulated_metadata"


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

    @property
    def storage_path(self) -> str:
        """A directory every host and the driver see (a shared mount's stand-in):
        where checkpoints go (``GRPOConfig(checkpoint_dir=...)``, Ray Train's
        ``storage_path``). Removed with the cluster."""
        return os.path.join(self._disk, "shared")

    def host_root(self, key: HostKey) -> str:
        """The directory that is host `key`'s own disk (its ``TMPDIR`` is in it)."""
        return _host_root(self._disk, host_ip(*key))

    def host_env(self, key: HostKey) -> dict[str, str]:
        """The variables host `key` was started with (its raylet's, so its workers'),
        fault-injection overrides included; the defaults if it never started."""
        default = _tpu_vm_env if self.is_tpu_vm(*key) else _host_env
        return dict(self._envs.get(tuple(key)) or default(self._topologies.get(key[0], self.topology), *key))

    def is_tpu_vm(self, slice_id: int, worker_id: int) -> bool:
        """Whether the host is a TPU VM started with ``ray start`` (no GKE variables)."""
        return self.tpu_vm is True or (slice_id, worker_id) in (self.tpu_vm or ())

    def remove_host(self, slice_id: int, worker_id: int) -> None:
        """Take a host away, as a preempted or failed TPU VM (for fault tests).
        Also after its raylet exited by itself (a drained node does once idle)."""
        node = self._nodes.pop((slice_id, worker_id))
        self.hosts.pop((slice_id, worker_id))
        self.cluster.remove_node(node, allow_graceful=False)

    # Elastic and preemption fault injection (docs/elastic.md) ------------------

    def slice_hosts(self, slice_id: int) -> list[HostKey]:
        """The (slice id, worker id) of the slice's hosts that are up."""
        return sorted(k for k in self._nodes if k[0] == slice_id)

    def remove_slice(self, slice_id: int) -> None:
        """Kill every raylet of a slice at once, as a reclaimed TPU slice."""
        for key in self.slice_hosts(slice_id):
            self.remove_host(*key)

    def add_slice(self, slice_id: Optional[int] = None, *, topology: Optional[str] = None) -> int:
        """(Re)start every host of a slice, e.g. after `remove_slice`; or, with
        `topology` instead of a slice id, start a new slice of that shape (the
        cluster's accelerator type) beside the others, with the next free slice
        id, and wait until its hosts have joined: a cluster of several slice
        shapes, e.g. a two-host v4 ``"2x2x2"`` next to one-host ``"2x2x1"`` ones.
        Returns the slice id."""
        if (slice_id is None) == (topology is None):
            raise ValueError(f"add_slice(slice_id={slice_id!r}, topology={topology!r}): give the slice id of a "
                             "removed slice to restart it, or the topology of a new slice, e.g. topology='2x2x2'")
        if topology is None:
            topo = self._topologies.get(slice_id, self.topology)
        else:
            topo = Topology.parse(topology, self.topology.accelerator_type)
            slice_id = 1 + max([self.num_slices - 1, *self._topologies, *(s for s, _ in self._nodes)])
            self._topologies[slice_id] = topo
        for worker_id in range(topo.num_hosts):
            if (slice_id, worker_id) not in self._nodes:
                self.add_host(slice_id, worker_id, topology=topo)
        if topology is not None:
            self.cluster.wait_for_nodes()
        return slice_id

    def node_id(self, slice_id: int, worker_id: int) -> str:
        """Ray's node id (hex) of a host."""
        return self._nodes[(slice_id, worker_id)].node_id

    def drain_host(self, slice_id: int, worker_id: int, deadline_s: float, reason: str = "simulated preemption") -> None:
        """Ray's own preemption notice for a host: a drain (reason PREEMPTION) with a
        deadline, as ``ray start`` does on SIGTERM or KubeRay before deleting a pod.
        Nothing is killed: call `remove_host` (or `remove_slice`) at the deadline."""
        from ray_train_tpu._compat import ray_train as compat_ray

        accepted, message = compat_ray.drain_node(self.node_id(slice_id, worker_id), deadline_s, reason)
        if not accepted:
            raise RuntimeError(f"Ray refused to drain host {(slice_id, worker_id)}: {message}")

    def preempt_host(self, slice_id: int, worker_id: int, deadline_s: float) -> list[int]:
        """A spot VM's shutdown notice: ``ray start`` drains the node (`drain_host`) and
        every process gets SIGTERM (`signal_workers`). The host itself stays up:
        `remove_host` it by the deadline, as the VM goes away."""
        import signal

        self.drain_host(slice_id, worker_id, deadline_s, reason="simulated spot VM shutdown (SIGTERM)")
        return self.signal_workers(slice_id, worker_id, signal.SIGTERM)

    def signal_workers(self, slice_id: int, worker_id: int, signum: int) -> list[int]:
        """Send `signum` to every Ray worker process on a host (not its raylet or
        agents) and return their pids: SIGTERM as a spot VM's shutdown sends it,
        SIGSTOP for a host that stalls mid-step (`stall_host`)."""
        import os

        import psutil

        from ray_train_tpu._compat import ray_train as compat_ray

        raylet = compat_ray.raylet_pid(self._nodes[(slice_id, worker_id)])
        pids = []
        for child in psutil.Process(raylet).children(recursive=True):
            try:
                if _is_ray_worker(child.cmdline()):
                    os.kill(child.pid, signum)
                    pids.append(child.pid)
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
        return pids

    def stall_host(self, slice_id: int, worker_id: int) -> list[int]:
        """Freeze every worker process of a host (SIGSTOP), wherever it is in its
        step: the others wait in their next collective. `resume_host` undoes it."""
        import signal

        return self.signal_workers(slice_id, worker_id, signal.SIGSTOP)

    def resume_host(self, slice_id: int, worker_id: int) -> list[int]:
        import signal

        return self.signal_workers(slice_id, worker_id, signal.SIGCONT)

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
        extra = _disk_env(self._disk, host_ip(slice_id, worker_id), self._ray_tmp)
        if stall_s:
            extra[C.RAY_TRAIN_TPU_SIMULATE_STALL_S] = str(stall_s)
        topology = topology or self._topologies.get(slice_id, self.topology)
        self._nodes[key], self._envs[key] = _add_host(
            self.cluster, topology, slice_id, worker_id, self._cpus, extra,
            env=env, labels=labels, resources=resources, tpu_vm=self.is_tpu_vm(slice_id, worker_id),
        )
        self.hosts[key] = host_ip(slice_id, worker_id)

    _cpus: int = 0
    _envs: dict = dataclasses.field(default_factory=dict, repr=False)
    _topologies: dict = dataclasses.field(default_factory=dict, repr=False)  # slice id -> shape, where not `topology`
    tpu_vm: object = False  # True or the hosts that are TPU VMs started with `ray start` (`simulated_tpu_cluster`)
    _disk: str = ""  # the cluster's disks: hosts/<ip>/ (one per host, and the head's), shared/
    _ray_tmp: str = ""  # Ray's own temporary directory (sessions, sockets), the same for every host


def _host_root(disk: str, ip: str) -> str:
    return os.path.join(disk, "hosts", ip)


def _disk_env(disk: str, ip: str, ray_tmp: str) -> dict[str, str]:
    """A host's own disk: its TMPDIR, in its root; Ray's directory stays where it was."""
    root = _host_root(disk, ip)
    os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
    return {C.TMPDIR: os.path.join(root, "tmp"), C.RAY_TMPDIR: ray_tmp, C.RAY_TRAIN_TPU_SIMULATE_HOST_ROOT: root}


def host_sees(path: str, host_root: Optional[str]) -> bool:
    """Whether a simulated host whose own disk is `host_root` sees `path`: not
    when the path is on another simulated host's disk (a sibling of `host_root`).
    Paths elsewhere on the machine stand for shared storage. `host_root` None
    (not a simulated host): True."""
    if not host_root:
        return True
    own = os.path.realpath(host_root)
    target = os.path.realpath(path)

    def under(p: str, root: str) -> bool:
        return os.path.commonpath([p, root]) == root

    return not under(target, os.path.dirname(own)) or under(target, own)


def _is_ray_worker(cmdline: list) -> bool:
    """A Ray worker process: ``default_worker.py`` until it names itself with
    setproctitle (``ray::RayTrainWorker``, ``ray::IDLE``); not the raylet's agents."""
    title = cmdline[0].split()[0] if cmdline and cmdline[0] else ""
    if title.startswith("ray::"):
        return not title.endswith("Agent")
    return any("default_worker.py" in part for part in cmdline)


def _host_env(topology: Topology, slice_id: int, worker_id: int) -> dict[str, str]:
    """What a GKE TPU node's Ray worker pod carries (docs/environment.md), plus
    the simulated hardware: GKE's TPU device plugin (``InitEnvs``), KubeRay's TPU
    webhook (``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``; here the
    hosts' addresses, as DNS names would resolve) and the physical coordinates
    of the host's chips (`chip_layout`)."""
    hosts = topology.num_hosts
    env = {
        C.TPU_NAME: slice_name(slice_id),
        C.TPU_WORKER_ID: str(worker_id),
        C.TPU_WORKER_HOSTNAMES: ",".join(host_ip(slice_id, w) for w in range(hosts)) if hosts > 1 else "localhost",
        **gke_device_plugin_env(topology),
        C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS: format_chip_layout(chip_layout(topology, worker_id)),
    }
    if topology.devices_per_chip > 1:
        env[C.RAY_TPU_RESOURCE_PER_CHIP] = str(topology.devices_per_chip)
    return env


def _tpu_vm_env(topology: Topology, slice_id: int, worker_id: int) -> dict[str, str]:
    """What a TPU VM started with ``ray start`` carries: none of GKE's variables;
    the simulated hardware (`chip_layout`) and its GCE metadata server's answers
    (`gce_metadata`), from which Ray names the node."""
    env = {
        C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA: json.dumps(gce_metadata(topology, slice_id, worker_id)),
        C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS: format_chip_layout(chip_layout(topology, worker_id)),
    }
    if topology.devices_per_chip > 1:
        env[C.RAY_TPU_RESOURCE_PER_CHIP] = str(topology.devices_per_chip)
    return env


def gce_metadata(topology: Topology, slice_id: int, worker_id: int) -> dict[str, str]:
    """The instance attributes a TPU VM's GCE metadata server gives the keys Ray 2.60
    asks for (``ray._private.accelerators.tpu``: ``instance-id``,
    ``agent-worker-number``, ``accelerator-type``, ``tpu-env``).

    Example:
        >>> md = gce_metadata(Topology.parse("2x2x2", "TPU-V4"), 1, 0)
        >>> md["instance-id"], md["agent-worker-number"], md["accelerator-type"]
        ('sim-slice-1', '0', 'v4-16')
    """
    pod_type = gke_device_plugin_env(topology)[C.TPU_ACCELERATOR_TYPE]
    tpu_env = f"ACCELERATOR_TYPE: '{pod_type}'\nTOPOLOGY: '{topology.name}'\nWORKER_ID: '{worker_id}'\n"
    return {"instance-id": slice_name(slice_id), "agent-worker-number": str(worker_id),
            "accelerator-type": pod_type, "tpu-env": tpu_env}


def gke_device_plugin_env(topology: Topology) -> dict[str, str]:
    """The variables GKE's TPU device plugin gives a container that requests all
    chips of a host of `topology` (its ``InitEnvs``: accelerator type in GKE's
    spelling, e.g. ``tpu7x-8``; host bounds = mesh / chips per host; torus wrap
    on 3-D slices of 4x4x4 and up, and on v5e/v6e sides of 16).

    Example:
        >>> env = gke_device_plugin_env(Topology.parse("2x2x2", "TPU-V4"))
        >>> env["TPU_HOST_BOUNDS"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_ACCELERATOR_TYPE"]
        ('1,1,2', '2,2,1', 'v4-16')
    """
    gen = topology.generation
    prefix = "tpu7x" if gen.accelerator_type == "TPU-V7X" else gen.pod_prefix
    mesh = topology.bounds
    if gen.num_dims == 3:
        wrap = ["true" if all(d >= 4 for d in mesh) else "false"] * 3
    else:
        wrap = ["true" if d == 16 else "false" for d in mesh]
    host_bounds = ",".join(str(m // h) for m, h in zip(mesh, topology.host_bounds))
    chips = ",".join(str(h) for h in topology.host_bounds)
    env = {
        C.TPU_SKIP_MDS_QUERY: "true",
        C.TPU_RUNTIME_METRICS_PORTS: ",".join(str(8431 + i) for i in range(topology.chips_per_host)),
        C.TPU_TOPOLOGY: topology.name,
        C.TPU_ACCELERATOR_TYPE: f"{prefix}-{topology.num_chips * gen.cores_per_chip}",
        C.TPU_TOPOLOGY_ALT: "false", C.ALT: "false",
        C.TPU_TOPOLOGY_WRAP: ",".join(wrap), C.WRAP: ",".join(wrap),
        C.TPU_HOST_BOUNDS: host_bounds, C.HOST_BOUNDS: host_bounds,
        C.TPU_CHIPS_PER_HOST_BOUNDS: chips, C.CHIPS_PER_HOST_BOUNDS: chips,
    }
    if gen.num_dims == 3 and all(d >= 4 for d in mesh):
        env[C.ENABLE_ICI_RESILIENCY] = "true"
    return env


def chip_layout(topology: Topology, position: int, first: Optional[Sequence[int]] = None) -> list[tuple[int, int, int]]:
    """Physical coordinates of the chips of the host at `position` of the mesh
    (or whose first chip is at `first`), in chip-index order (X-minor).

    Example:
        >>> chip_layout(Topology.parse("2x2x2", "TPU-V4"), 1)
        [(0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    """
    own = [topology.chip_coords(position, i) for i in range(topology.chips_per_host)]
    if first is None:
        return own
    return [tuple(f + c - o for f, c, o in zip(first, chip, own[0])) for chip in own]


def format_chip_layout(chips: Sequence[Sequence[int]]) -> str:
    return ";".join(",".join(str(v) for v in chip) for chip in chips)


def _overlay(base: Mapping, overrides: Optional[Mapping]) -> dict:
    """`base` updated with `overrides`; a ``None`` value removes the key."""
    out = {**base, **(overrides or {})}
    return {k: v for k, v in out.items() if v is not None}


def _add_host(cluster, topology: Topology, slice_id: int, worker_id: int, cpus: int, extra_env=None,
              *, env=None, labels=None, resources=None, tpu_vm=False):
    """Start one host's raylet. `extra_env` goes to the raylet only; `env`,
    `labels` and `resources` override the host's usual ones (see `add_host`).
    A TPU VM (`tpu_vm`) gets no TPU labels, slice or head resources from us:
    Ray derives them from its (simulated) GCE metadata, as on a real one."""
    from ray_train_tpu._compat import ray_tpu as compat_ray_tpu

    removed = [k for k, v in (env or {}).items() if v is None]
    env = _overlay((_tpu_vm_env if tpu_vm else _host_env)(topology, slice_id, worker_id), env)
    # A raylet inherits this process's environment; a host's TPU variables are
    # the host's own, never what the driver picked up (importing libtpu, as
    # torch_tpu does, sets TPU_LIBRARY_PATH here). Our own RAY_TRAIN_TPU_* knobs pass.
    removed += [k for k in os.environ
                if in_scope(k) and not k.startswith("RAY_TRAIN_TPU_")
                and k not in env and k not in SIMULATION_ENV and k not in (extra_env or {})]
    name = slice_name(slice_id)
    node_resources = {
        "TPU": topology.devices_per_host,
        f"accelerator_type:{topology.accelerator_type}": 1,
        name: 1,
    }
    if worker_id == 0:
        node_resources[f"TPU-{topology.pod_type}-head"] = 1
    if tpu_vm:
        node_resources = {k: v for k, v in node_resources.items() if k == "TPU" or k.startswith("accelerator_type:")}
    node_labels = {} if tpu_vm else {
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
    env_vars = {**SIMULATION_ENV, **env, **(extra_env or {})}
    metadata = env.get(C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA)
    undo_metadata = compat_ray_tpu.answer_metadata_server(json.loads(metadata)) if metadata else (lambda: None)
    try:
        node = cluster.add_node(
            node_ip_address=host_ip(slice_id, worker_id),
            num_cpus=cpus,
            resources=_overlay(node_resources, resources),
            labels=_overlay(node_labels, labels),
            env_vars=env_vars,
            object_store_memory=_OBJECT_STORE_BYTES,
        )
        return node, env_vars
    finally:
        undo_metadata()
        _environ.unset(k for k in env if k not in saved)
        _environ.update(saved)


def _coords_env(topology: Topology, key, coords, keys) -> dict[str, str]:
    if tuple(key) not in keys:
        raise ValueError(f"host_coords key {key!r} is not a (slice id, worker id) of a started host")
    values = list(coords) if isinstance(coords, (list, tuple)) else None
    if values is None or len(values) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                     for v in values):
        raise ValueError(
            f"host_coords[{tuple(key)!r}] = {coords!r} must be the chip coordinates (x, y, z) of the "
            "host's first chip: three non-negative integers, e.g. (0, 0, 2)"
        )
    return {C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS: format_chip_layout(chip_layout(topology, key[1], values))}


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
    system_config: Optional[Mapping[str, object]] = None,
    tpu_vm: Union[bool, Sequence[HostKey]] = False,
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
            of some hosts, by ``(slice id, worker id)`` (the other chips of the
            host follow it, X-minor). By default every host's chips sit where
            its worker id puts them in the mesh. Each host's libtpu reports them
            (`ray_train_tpu.testing.simulated_libtpu`) to torch_tpu's coordinate
            query, which orders a multi-host slice (torch_tpu's Z-major order)
            whatever its ``TPU_WORKER_ID`` (which `host_env` may shuffle or repeat).
        cpus_per_host: logical CPUs per host; default chips + 1, because each of
            Ray Train's TPU bundles also asks for one CPU.
        connect: ``ray.init`` the driver to the cluster (default True).
        system_config: Ray's ``_system_config`` for the head (GCS), e.g.
            ``{"health_check_period_ms": 1000, "health_check_failure_threshold": 3}``
            for a cluster that notices a killed host in ~3 s instead of ~15 s.
        tpu_vm: True, or the ``(slice id, worker id)`` of some hosts: hosts that
            are TPU VMs started with ``ray start`` rather than GKE pods: no ``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_ACCELERATOR_TYPE``,
            ``TPU_TOPOLOGY`` or other GKE variables; Ray names each node (its
            ``ray.io/tpu-*`` labels, slice and head resources) from a simulated
            GCE metadata server (`gce_metadata`), which also answers Ray's
            queries in the job's workers (a worker setup hook in the driver's
            ``ray.init``, so with ``connect=True`` only).

    `add_host`, `add_slice` and the other fault injections start raylets: call
    them from the main thread (Ray's node sets a SIGTERM handler); run ``fit()``
    in another thread meanwhile.
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
    for key in () if isinstance(tpu_vm, bool) else tpu_vm:
        if tuple(key) not in keys:
            raise ValueError(f"tpu_vm entry {key!r} is not a (slice id, worker id) of a started host; "
                             "pass True for every host, or keys such as (0, 1)")
    for key, coords in (host_coords or {}).items():
        host_env[tuple(key)] = {**host_env.get(tuple(key), {}), **_coords_env(topo, key, coords, keys)}
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
    from ray._common.utils import get_default_system_temp_dir

    ray_tmp = get_default_system_temp_dir()
    disk = tempfile.mkdtemp(prefix="rtt-sim-")  # short: Ray's socket paths are not under it
    os.makedirs(os.path.join(disk, "shared"))
    head_disk = _disk_env(disk, HEAD_IP, ray_tmp)
    _environ.update(driver_env)
    undo_metadata_guard = compat_ray.forbid_metadata_server()
    cluster = None
    driver_disk = _environ.snapshot(head_disk)
    saved_tempdir = tempfile.tempdir
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
                env_vars={**driver_env, **head_disk},
                **({"_system_config": dict(system_config)} if system_config else {}),
            ),
        )
        sim = SimulatedTPUCluster(
            topology=topo, num_slices=num_slices, address=cluster.address, hosts={}, cluster=cluster
        )
        sim._cpus, sim._disk, sim._ray_tmp = cpus, disk, ray_tmp
        sim.tpu_vm = True if tpu_vm is True else frozenset(tuple(k) for k in (tpu_vm or ()))
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
                runtime_env={"env_vars": {**driver_env, C.RAY_ADDRESS: cluster.address},
                             **({"worker_process_setup_hook": _METADATA_HOOK} if tpu_vm else {})},
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
        logger.info("simulated %d x %s: %d hosts up", num_slices, topo, len(sim.hosts))
        # The driver is on the head host: its temporary files are on the head's disk.
        _environ.update(head_disk)
        tempfile.tempdir = None  # tempfile.gettempdir() reads TMPDIR again
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
            _environ.unset(k for k in head_disk if k not in driver_disk)
            _environ.update(driver_disk)
            tempfile.tempdir = saved_tempdir
            shutil.rmtree(disk, ignore_errors=True)
