"""A statement of a TPU worker's whole environment when torch_tpu starts, to test against.

One Ray Train worker per TorchTPU device (a chip; a TensorCore on v7x) on a
slice of hosts. Each variable says its value, who sets it and who reads it;
docs/environment.md is the same statement in prose, with its sources. It is
written from the upstream conventions directly, not from `launch_env` (the
code under test):

- the host: GKE's TPU device plugin (``InitEnvs``) and KubeRay's TPU webhook
  (``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``), passed in as
  `host_env`; ``RAY_TPU_RESOURCE_PER_CHIP`` where the cluster sets it (v7x);
- Ray 2.60 (``TPUAcceleratorManager.set_current_process_visible_accelerator_ids``):
  a one-chip mask and bounds, all replaced by ours;
- ours (`ray_train_tpu`): torch's rendezvous variables, torch_tpu's launcher
  variables, and libtpu's per-process view as torch_tpu sets it at PJRT start;
- torch_tpu itself at PJRT start (`torch_tpu_sets`), from ours: what must NOT
  be set before (it overwrites them all).

`in_scope` names the variables a check looks at: every one whose name says it
is TPU's, torch_tpu's, torch's rendezvous', MegaScale's or ours, so that an
unexpected one fails a check as a missing one does.

Example:
    >>> from ray_train_tpu.topology import Topology
    >>> t = Topology.parse("2x2x2", "TPU-V4")
    >>> s = statement(t, ["10.0.0.1", "10.0.0.2"], rank=5, master_port=29500, session="1", host_env={})
    >>> s["TPU_VISIBLE_CHIPS"].value, s["TPU_HOST_BOUNDS"].value, s["TPU_VISIBLE_DEVICES"].value
    ('1', '2,2,2', None)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from ray_train_tpu import constants as C
from ray_train_tpu.topology import Topology

HOST, RAY, OURS, TORCH_TPU, SIM = "host (GKE, KubeRay)", "Ray 2.60", "ray_train_tpu", "torch_tpu at PJRT start", "simulation"

_PREFIXES = ("TPU_", "TORCH_TPU_", "MEGASCALE_", "CLOUD_TPU_", "RAY_TRAIN_TPU_", "LIBTPU_", "PJRT_")
_NAMES = frozenset({
    C.RANK, C.WORLD_SIZE, C.LOCAL_RANK, C.LOCAL_WORLD_SIZE, C.NODE_RANK, C.NNODES, C.MASTER_ADDR, C.MASTER_PORT,
    C.JOB_COMPLETION_INDEX, C.HOST_BOUNDS, C.CHIPS_PER_HOST_BOUNDS, C.WRAP, C.ALT, C.ENABLE_ICI_RESILIENCY,
    C.VBAR_CONTROL_SERVICE_URL, C.ALLOW_MULTIPLE_LIBTPU_LOAD, C.RAY_TPU_RESOURCE_PER_CHIP,
    C.TORCH_DEVICE_BACKEND_AUTOLOAD, "XLA_FLAGS",
})
# What GKE and KubeRay put on a TPU host that we leave as it is.
_HOST_KEPT = (C.TPU_NAME, C.TPU_ACCELERATOR_TYPE, C.TPU_TOPOLOGY, C.TPU_SKIP_MDS_QUERY, C.TPU_RUNTIME_METRICS_PORTS,
              C.TPU_TOPOLOGY_WRAP, C.WRAP, C.TPU_TOPOLOGY_ALT, C.ALT, C.HOST_BOUNDS, C.CHIPS_PER_HOST_BOUNDS,
              C.ENABLE_ICI_RESILIENCY, C.VBAR_CONTROL_SERVICE_URL, C.RAY_TPU_RESOURCE_PER_CHIP)


def in_scope(name: str) -> bool:
    """Whether a check of a worker's environment looks at variable `name`."""
    return name.startswith(_PREFIXES) or name in _NAMES


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    value: Optional[str]  # None: must not be set when torch_tpu starts
    set_by: str
    read_by: str


def statement(topology: Topology, hosts: Sequence[str], *, rank: int, master_port: int, session: str,
              host_env: Mapping[str, str], num_slices: int = 1, base_port: int = C.DEFAULT_TORCH_TPU_BASE_PORT,
              megascale_port: int = C.DEFAULT_MEGASCALE_PORT, simulated: bool = False) -> dict[str, Variable]:
    """Every in-scope variable of the worker of `rank`, with `hosts` the job's
    hosts in slice order (slice-major), `host_env` what its host carries."""
    per_host, per_slice = topology.devices_per_host, topology.num_devices
    node, local = divmod(rank, per_host)
    slice_id = rank // per_slice
    slice_hosts = list(hosts[slice_id * topology.num_hosts:(slice_id + 1) * topology.num_hosts])
    mesh = ",".join(str(b) for b in topology.bounds) + (f",{topology.devices_per_chip}"
                                                         if topology.devices_per_chip > 1 else "")
    one = "1,1,1,1" if topology.devices_per_chip > 1 else "1,1,1"
    out: dict[str, Variable] = {}

    def put(name, value, set_by, read_by):
        out[name] = Variable(name, None if value is None else str(value), set_by, read_by)

    for name in _HOST_KEPT:
        if name in host_env:
            put(name, host_env[name], HOST, "Ray (TPU_NAME, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY: its TPU "
                "resources and labels; RAY_TPU_RESOURCE_PER_CHIP: TPU ids), libtpu, us (slice and topology)")
    for name, value in ((C.RANK, rank), (C.WORLD_SIZE, per_slice * num_slices), (C.LOCAL_RANK, local),
                        (C.LOCAL_WORLD_SIZE, per_host), (C.NODE_RANK, node),
                        (C.NNODES, topology.num_hosts * num_slices), (C.MASTER_ADDR, hosts[0]),
                        (C.MASTER_PORT, master_port)):
        put(name, value, f"{OURS} (= Ray Train's ranks)", "torch.distributed, torch_tpu")
    put(C.TPU_WORKER_ID, node % topology.num_hosts, f"{OURS} over {HOST}", "libtpu, torch_tpu's launcher")
    put(C.TPU_WORKER_HOSTNAMES, ",".join(slice_hosts), f"{OURS} over {HOST}", "libtpu, torch_tpu's launcher")
    put(C.TORCH_TPU_SLICEBUILDER_ADDRESSES,
        ",".join(f"{h}:{base_port + i}" for h in slice_hosts for i in range(per_host)), OURS, "torch_tpu")
    put(C.TORCH_TPU_TOPOLOGY, mesh, OURS, "torch_tpu")
    put(C.TORCH_TPU_XPROF_SESSION_ID, session, OURS, "torch_tpu's profiler")
    # libtpu's view of one process per device: torch_tpu's (it sets the same at PJRT start)
    for name, value in ((C.TPU_VISIBLE_CHIPS, local), (C.TPU_HOST_BOUNDS, mesh), (C.TPU_CHIPS_PER_HOST_BOUNDS, one),
                        (C.TPU_PROCESS_BOUNDS, mesh), (C.TPU_CHIPS_PER_PROCESS_BOUNDS, one)):
        put(name, value, f"{OURS} over {RAY} and {HOST}", "libtpu")
    for name, value in ((C.MEGASCALE_COORDINATOR_ADDRESS, f"{hosts[0]}:{megascale_port}"),
                        (C.MEGASCALE_NUM_SLICES, num_slices), (C.MEGASCALE_SLICE_ID, slice_id),
                        (C.MEGASCALE_PORT, megascale_port + 2 * local),
                        (C.MEGASCALE_DEBUG_PORT, megascale_port + 1 + 2 * local)):
        put(name, value if num_slices > 1 else None, OURS, "libtpu (multi-slice only)")
    for name in (C.TPU_VISIBLE_DEVICES, C.CLOUD_TPU_TASK_ID, C.TPU_PROCESS_ADDRESSES, C.TPU_PROCESS_PORT,
                 C.ALLOW_MULTIPLE_LIBTPU_LOAD, C.JOB_COMPLETION_INDEX):
        put(name, None, TORCH_TPU if name != C.JOB_COMPLETION_INDEX else "Kubernetes Indexed Jobs only",
            "libtpu" if name != C.JOB_COMPLETION_INDEX else "torch_tpu's launcher")
    # GKE sets "true"; a simulated cluster's job sets "1" over it (Ray's job env wins over the raylet's)
    put(C.TPU_SKIP_MDS_QUERY, "1" if simulated else host_env.get(C.TPU_SKIP_MDS_QUERY), HOST, "libtpu")
    if simulated:
        for name, value in C.SIMULATION_ENV.items():
            if name != C.TPU_SKIP_MDS_QUERY:
                put(name, value, SIM, "us, torch")
        put(C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS, host_env.get(C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS), SIM,
            "ray_train_tpu.testing.simulated_libtpu")
        put(C.RAY_TRAIN_TPU_SIMULATE_HOST_ROOT, host_env.get(C.RAY_TRAIN_TPU_SIMULATE_HOST_ROOT), SIM,
            "ray_train_tpu's checks of model and checkpoint directories (the simulated host's own disk)")
    return out


def torch_tpu_sets(env: Mapping[str, str]) -> dict[str, str]:
    """What torch_tpu 0.2.0 sets (overwriting) at PJRT start in a process with
    `env` and a WORLD_SIZE (``InitializeDistributedEnvironment`` in its native
    library; tests/unit/test_torch_tpu_conformance.py runs that code and
    compares). The process's device is ``TPU_VISIBLE_DEVICES`` when it is one
    index, else ``LOCAL_RANK``."""
    addresses = env[C.TORCH_TPU_SLICEBUILDER_ADDRESSES].split(",")
    rank, local, world = int(env[C.RANK]), int(env[C.LOCAL_RANK]), int(env[C.WORLD_SIZE])
    mesh = env[C.TORCH_TPU_TOPOLOGY]
    one = "1,1,1,1" if len(mesh.split(",")) == 4 else "1,1,1"
    device = env.get(C.TPU_VISIBLE_DEVICES, "")
    device = device if device.isdigit() else str(local)
    out = {
        C.CLOUD_TPU_TASK_ID: str(rank % len(addresses)),
        C.TPU_VISIBLE_DEVICES: device, C.TPU_VISIBLE_CHIPS: device,
        C.TPU_HOST_BOUNDS: mesh, C.TPU_CHIPS_PER_HOST_BOUNDS: one,
        C.TPU_PROCESS_BOUNDS: mesh, C.TPU_CHIPS_PER_PROCESS_BOUNDS: one,
        C.TPU_PROCESS_PORT: addresses[rank % len(addresses)].rpartition(":")[2],
        C.TPU_PROCESS_ADDRESSES: ",".join(addresses),
        C.ALLOW_MULTIPLE_LIBTPU_LOAD: "1",
    }
    if len(addresses) < world:  # several slices
        out[C.MEGASCALE_PORT] = str(8080 + 2 * local)
        out[C.MEGASCALE_DEBUG_PORT] = str(8081 + 2 * local)
    return out
