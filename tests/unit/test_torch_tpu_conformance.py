"""launch_env against torch_tpu's own launcher, run as torch_tpu ships it.

`python -m torch_tpu._internal.distributed.distributed` prints the environment
it would give one host of a multi-host job. For every host of several slices
we run it and compare with `launch_env`. Every child has TPU_SKIP_MDS_QUERY=1,
so libtpu never queries the cloud metadata server.
"""

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ray_train_tpu.launch_env import launch_envs
from ray_train_tpu.topology import Topology

pytest.importorskip("torch_tpu", reason="needs the [tpu] extra (torch-tpu)")
pytestmark = pytest.mark.slow

SLICES = [("2x2x2", "TPU-V4"), ("4x4", "TPU-V6E"), ("2x2x4", "TPU-V5P"), ("2x2x2", "TPU-V7X")]
SESSION = "1234567890"


def _child_env(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_TPU_", "TPU_", "MASTER_", "NODE_RANK", "NNODES", "JOB_COMPLETION"))}
    env.update({"TPU_SKIP_MDS_QUERY": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    env.update(extra)
    return env


def _run_launcher(hosts, index, devices_per_host, topology):
    env = _child_env({
        "TPU_WORKER_HOSTNAMES": ",".join(hosts),
        "JOB_COMPLETION_INDEX": str(index),
        "TORCH_TPU_DEVICES_PER_HOST": str(devices_per_host),
        "TORCH_TPU_TOPOLOGY": topology,
        "TORCH_TPU_XPROF_SESSION_ID": SESSION,
    })
    out = subprocess.run(
        [sys.executable, "-m", "torch_tpu._internal.distributed.distributed"],
        env=env, capture_output=True, text=True, timeout=240, check=True,
    ).stdout
    values = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier() and key.isupper():
            values[key] = shlex.split(value)[0] if value else ""
    return values


@pytest.fixture(scope="module")
def launcher_outputs():
    jobs = []
    for name, accel in SLICES:
        t = Topology.parse(name, accel)
        hosts = [f"host-{i}.example" for i in range(t.num_hosts)]
        for k in range(t.num_hosts):
            jobs.append(((name, accel, k), (hosts, k, t.devices_per_host, t.torch_tpu_topology)))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: _run_launcher(*job[1]), jobs))
    return {key: result for (key, _), result in zip(jobs, results)}


@pytest.mark.parametrize("name, accel", SLICES)
def test_every_host_matches_torch_tpu_launcher(launcher_outputs, name, accel):
    t = Topology.parse(name, accel)
    hosts = [f"host-{i}.example" for i in range(t.num_hosts)]
    ours = {p.worker_id: env for p, env in launch_envs(t, hosts, xprof_session_id=SESSION)}
    for k in range(t.num_hosts):
        theirs = launcher_outputs[(name, accel, k)]
        env = ours[k]
        for key in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "TORCH_TPU_XPROF_SESSION_ID",
                    "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
            assert env[key] == theirs[key], (name, accel, k, key)


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
