"""launch_env against torch_tpu's own code, given only what the platform gives.

1. torch_tpu's launcher (``python -m torch_tpu._internal.distributed.distributed``
   prints the environment it gives one host) gets what a TPU platform gives a
   host and nothing of ours: the hosts' names (``TPU_WORKER_HOSTNAMES``, GKE's
   order), and either a Kubernetes completion index or the chip coordinates
   libtpu reports with the slice's mesh as GKE spells it (``TPU_TOPOLOGY``).
   The host's hardware is what torch_tpu's PCI scan would find (the device
   count of the generation, torch_tpu's own topology table); nothing else of
   torch_tpu is replaced. Every value it prints is compared with ours.
2. torch_tpu's native ``InitializeDistributedEnvironment`` (what it sets at PJRT
   start: libtpu's per-process view) runs on our environment of a worker, and
   what it sets is compared with what we set before it: the same, or a stated
   conflict (`ray_train_tpu.testing.worker_env.torch_tpu_sets`).

Every child has TPU_SKIP_MDS_QUERY=1 (libtpu never asks a metadata server); no
child starts a PJRT client.
"""

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ray_train_tpu.launch_env import launch_envs
from ray_train_tpu.testing.worker_env import torch_tpu_sets
from ray_train_tpu.topology import Topology

import torch_tpu  # noqa: E402,F401  (the [tpu] extra, which make test installs: never skipped)
pytestmark = pytest.mark.slow

# torch_tpu's names of the generations (hardware._PCI_DEVICE_ID_TO_NAME)
CHIP_NAMES = {"TPU-V4": "TPU v4", "TPU-V5P": "TPU v5p", "TPU-V6E": "TPU v6e", "TPU-V7X": "TPU v7"}
BY_COORDS = [("2x2x2", "TPU-V4"), ("4x4", "TPU-V6E"), ("2x2x2", "TPU-V7X")]  # v5p: as v4
BY_INDEX = [("2x2x2", "TPU-V4"), ("2x2x2", "TPU-V7X")]
SESSION = "1234567890"

# The launcher as shipped, on a host whose PCI scan finds `devices` TPU devices of
# `chip` and whose libtpu reports `coords` (platform facts; torch_tpu's tables do the rest).
LAUNCHER = """
import json, sys
from torch_tpu._internal.distributed import distributed as d
from torch_tpu._internal.utils import hardware
spec = json.loads(sys.argv[1])
pci = next(i for i, n in hardware._PCI_DEVICE_ID_TO_NAME.items() if n == spec["chip"])
hardware._scan_pci_tpus = lambda: (spec["devices"], hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID[pci])
d._query_local_device_coords = lambda: spec["coords"]
d._print_launch_env()
"""


def _child_env(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCH_TPU_", "TPU_", "MASTER_", "NODE_RANK", "NNODES", "JOB_COMPLETION", "RANK",
                                "LOCAL_RANK", "WORLD_SIZE", "MEGASCALE_", "CLOUD_TPU_"))}
    env.update({"TPU_SKIP_MDS_QUERY": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    env.update(extra)
    return env


def _hosts(t):
    return [f"host-{i}.example" for i in range(t.num_hosts)]


def _run_launcher(t, k, mode):
    spec = {"chip": CHIP_NAMES[t.accelerator_type], "devices": t.devices_per_host,
            "coords": list(t.chip_coords(k, 0)) if mode == "coords" else None}
    env = {"TPU_WORKER_HOSTNAMES": ",".join(_hosts(t))}
    if mode == "coords":
        env["TORCH_TPU_TOPOLOGY"] = t.name  # GKE's TPU_TOPOLOGY, verbatim ("2x2x2")
    else:
        env["JOB_COMPLETION_INDEX"] = str(k)
    out = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(spec)], env=_child_env(env),
                         capture_output=True, text=True, timeout=240, check=True).stdout
    values = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier() and key.isupper():
            values[key] = shlex.split(value)[0] if value else ""
    return values


@pytest.fixture(scope="module")
def launcher_outputs():
    jobs = [(name, accel, k, mode) for mode, cases in (("coords", BY_COORDS), ("index", BY_INDEX))
            for name, accel in cases for k in range(Topology.parse(name, accel).num_hosts)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda j: _run_launcher(Topology.parse(j[0], j[1]), j[2], j[3]), jobs))
    return dict(zip(jobs, results))


def _mesh(text):
    """X, Y, Z of a mesh as torch_tpu parses it (``_parse_topology``: 'x' or ',', missing = 1)."""
    fields = [int(p) for p in text.replace("x", ",").split(",")][:3]
    return fields + [1] * (3 - len(fields))


@pytest.mark.parametrize("mode, name, accel", [("coords", *c) for c in BY_COORDS] + [("index", *c) for c in BY_INDEX])
def test_every_value_the_launcher_derives_matches_ours(launcher_outputs, mode, name, accel):
    t = Topology.parse(name, accel)
    ours = {p.worker_id: env for p, env in launch_envs(t, _hosts(t), xprof_session_id=SESSION)}
    sessions = set()
    for k in range(t.num_hosts):
        theirs, env = launcher_outputs[(name, accel, k, mode)], ours[k]
        for key in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
                    "WORLD_SIZE"):
            assert theirs[key] == env[key], (mode, name, accel, k, key)
        if mode == "coords":
            # the slice's mesh, as given (GKE's spelling); ours adds v7x's cores per chip
            assert theirs["TORCH_TPU_TOPOLOGY"] == t.name and _mesh(env["TORCH_TPU_TOPOLOGY"]) == _mesh(t.name)
        else:
            # Without a mesh from outside, the launcher writes the HOST's (its PCI scan): on a
            # multi-host slice that is not the slice torch_tpu's PJRT start needs (the process
            # bounds must hold WORLD_SIZE processes, see below). Ours is the slice's.
            host_mesh = _mesh(theirs["TORCH_TPU_TOPOLOGY"])
            assert host_mesh[0] * host_mesh[1] * host_mesh[2] == t.chips_per_host < t.num_chips
            assert _mesh(env["TORCH_TPU_TOPOLOGY"]) == list(t.bounds)
        # each launcher makes up its own profiling session (time.time_ns() per host); ours is one per job
        assert theirs["TORCH_TPU_XPROF_SESSION_ID"].isdigit() and env["TORCH_TPU_XPROF_SESSION_ID"] == SESSION
        sessions.add(theirs["TORCH_TPU_XPROF_SESSION_ID"])
        compared = {"TORCH_TPU_SLICEBUILDER_ADDRESSES", "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
                    "WORLD_SIZE", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID"}
        assert set(theirs) == compared, set(theirs) ^ compared  # nothing it derives goes unchecked


def test_host_order_matches_torch_tpu_function():
    """Our host order equals torch_tpu's `_get_slice_host_coordinates` for multi-host slices."""
    cases = [("2x2x2", "TPU-V4"), ("4x4x8", "TPU-V4"), ("8x16", "TPU-V6E"), ("4x8x8", "TPU-V5P"), ("4x4x4", "TPU-V7X")]
    code = (
        "import json,sys\n"
        "from torch_tpu._internal.distributed import distributed as d\n"
        "print('HOSTS=' + json.dumps({t: d._get_slice_host_coordinates(t) for t in sys.argv[1:]}))\n"
    )
    topologies = [Topology.parse(n, a) for n, a in cases]
    out = subprocess.run(
        [sys.executable, "-c", code] + [t.torch_tpu_topology for t in topologies],
        env=_child_env({}), capture_output=True, text=True, timeout=240, check=True,
    ).stdout
    line = next(l for l in out.splitlines() if l.startswith("HOSTS="))
    theirs = json.loads(line.removeprefix("HOSTS="))
    for t in topologies:
        assert [list(h) for h in t.host_coords] == theirs[t.torch_tpu_topology], t


# --- 2. what torch_tpu sets at PJRT start, from our environment -------------------------

# torch_tpu 0.2.0's native library for this torch (csrc/common/glue_<torch>/libpywrap_<torch>_common.so):
# GetDistributedWorkerConfiguration() reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
# TORCH_TPU_SLICEBUILDER_ADDRESSES and TORCH_TPU_TOPOLOGY; InitializeDistributedEnvironment(config)
# sets libtpu's variables (setenv). Called here by their C++ names; PjrtBackend, which calls
# them before it starts a client, is not. Both return absl types through a hidden first argument.
DERIVE = """
import ctypes, glob, json, os, sys
import torch, torch_tpu
glue = "glue_" + "_".join(torch.__version__.split("+")[0].split(".")[:2]) + "_0"
lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(torch_tpu.__file__), "csrc", "common", glue,
                                         "libpywrap_*_common.so"))[0])
get_config = lib._ZN9torch_tpu33GetDistributedWorkerConfigurationEv
initialize = lib._ZN9torch_tpu32InitializeDistributedEnvironmentERKNS_30DistributedWorkerConfigurationE
get_config.restype = initialize.restype = None
status_or = ctypes.create_string_buffer(4096)   # absl::StatusOr<DistributedWorkerConfiguration>
get_config(status_or)
assert ctypes.c_uint64.from_buffer(status_or).value == 1, "GetDistributedWorkerConfiguration failed"
status = ctypes.create_string_buffer(64)
initialize(status, ctypes.c_void_p(ctypes.addressof(status_or) + 8))
assert ctypes.c_uint64.from_buffer(status).value == 1, "InitializeDistributedEnvironment failed"
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
print("SET=" + json.dumps({n: (libc.getenv(n.encode()) or b"").decode() for n in json.loads(sys.argv[1])}))
"""
# (slice, accelerator, slices, rank): one slice of each shape, a v7x TensorCore, a multi-slice rank
CASES = [("2x2x2", "TPU-V4", 1, 5), ("4x4", "TPU-V6E", 1, 9), ("2x2x2", "TPU-V7X", 1, 11), ("2x2x2", "TPU-V4", 2, 14)]
RAY_MASK = {"TPU_VISIBLE_CHIPS": "1", "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1", "TPU_HOST_BOUNDS": "1,1,1"}


def _derive(case):
    name, accel, num_slices, rank = case
    t = Topology.parse(name, accel)
    hosts = [f"10.0.{s}.{h}" for s in range(num_slices) for h in range(t.num_hosts)]
    ours = launch_envs(t, hosts, num_slices=num_slices, xprof_session_id=SESSION)[rank][1]
    names = sorted(torch_tpu_sets(ours)) + ["LIBTPU_INIT_ARGS"]
    # Ray's one-chip values under ours, as the worker has them: ours replace them (apply_env)
    env = _child_env({**RAY_MASK, **ours})
    out = subprocess.run([sys.executable, "-c", DERIVE, json.dumps(names)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("SET="))
    return ours, json.loads(line.removeprefix("SET="))


@pytest.fixture(scope="module")
def derived():
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CASES, pool.map(_derive, CASES)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{c[0]}x{c[2]}-rank{c[3]}")
def test_torch_tpu_sets_at_pjrt_start_what_we_set_before(derived, case):
    ours, theirs = derived[case]
    stated = torch_tpu_sets(ours)
    assert {k: theirs[k] for k in stated} == stated  # the statement is torch_tpu's own behaviour
    for key in ("TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS",
                "TPU_CHIPS_PER_PROCESS_BOUNDS"):
        assert theirs[key] == ours[key], key  # ours before PJRT starts == torch_tpu's after: no flip
    t = Topology.parse(case[0], case[1])
    local = int(ours["LOCAL_RANK"])
    assert theirs["CLOUD_TPU_TASK_ID"] == str(case[3] % t.num_devices)  # its place among the slice's processes
    assert theirs["TPU_PROCESS_ADDRESSES"] == ours["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert theirs["TPU_PROCESS_PORT"] == str(8070 + local)
    if case[2] > 1:
        # torch_tpu sets every process's MegaScale ports itself (8080 + 2 * LOCAL_RANK and the
        # debug port next to it): ours are the same before it starts, and the coordinator is
        # rank 0's MegaScale port, not a debug port (docs/environment.md)
        for key in ("MEGASCALE_PORT", "MEGASCALE_DEBUG_PORT"):
            assert ours[key] == theirs[key], key
        assert ours["MEGASCALE_COORDINATOR_ADDRESS"] == f"{ours['MASTER_ADDR']}:8080"
        if local == 0:
            assert theirs["MEGASCALE_PORT"] == "8080"  # the coordinator's own process
    assert "--slicebuilder_use_insecure_grpc=true" in theirs["LIBTPU_INIT_ARGS"]
