"""doctor on a simulated cluster: healthy, then with every fault injected.

One cluster for the module: a healthy v4 2x2x2 slice (2 hosts), each host with
its own stand-in for libtpu's lockfile (simulated hosts share /tmp). The fault
test holds one host's lockfile and adds four broken hosts, then removes them.
"""

import fcntl
import io
import json
import os
import subprocess
import sys

import pytest

from ray_train_tpu.cli import main
from ray_train_tpu.doctor import SIMULATE_LIBTPU_LOCKFILE, SIMULATE_MISSING_MODULES
from ray_train_tpu.testing import simulated_tpu_cluster
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TIMEOUT = "90"  # seconds for the hosts' checks; worker start-up is slow on a busy 2-core machine


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    locks = tmp_path_factory.mktemp("locks")
    host_env = {(0, w): {SIMULATE_LIBTPU_LOCKFILE: str(locks / f"libtpu_lockfile_{w}")} for w in range(2)}
    with simulated_tpu_cluster("2x2x2", "TPU-V4", host_env=host_env, connect=False) as cluster:
        yield cluster, locks


def test_healthy_slice_exits_0(sim):
    cluster, locks = sim
    out = io.StringIO()
    code = main(["doctor", "--address", cluster.address, "--format", "json", "--timeout", TIMEOUT], out=out)
    report = json.loads(out.getvalue())
    assert code == 0 and report["healthy"] and report["problems"] == [], report["problems"]
    assert report["num_nodes"] == 3  # the head and two TPU hosts
    (slice_,) = report["slices"]
    assert (slice_["name"], slice_["pod_type"], slice_["worker_ids"]) == ("sim-slice-0", "v4-16", [0, 1])
    assert [(h["ip"], h["worker_id"], h["chips"]) for h in report["hosts"]] == [("127.0.1.1", 0, 4),
                                                                                 ("127.0.1.2", 1, 4)]
    for w, host in enumerate(report["hosts"]):
        assert host["probe"]["packages"]["torch_tpu"]["found"] and host["probe"]["packages"]["libtpu"]["found"]
        assert host["probe"]["lockfile"] == str(locks / f"libtpu_lockfile_{w}")
        assert host["probe"]["env"]["TPU_WORKER_ID"] == str(w)


@pytest.fixture
def faults(sim):
    """Host (0, 1)'s lockfile held by this process, and four broken hosts."""
    cluster, locks = sim
    lock = os.open(locks / "libtpu_lockfile_1", os.O_RDWR | os.O_CREAT)
    fcntl.lockf(lock, fcntl.LOCK_EX)
    added = []
    try:
        # Slice 1: worker 0 without torch_tpu; a second host that also says it is
        # worker 0 (a hand-set label), has 2 chips and no libtpu. Worker 1 is missing.
        for key, kwargs in [
            ((1, 0), dict(env={SIMULATE_MISSING_MODULES: "torch_tpu"})),
            ((1, 1), dict(env={SIMULATE_MISSING_MODULES: "libtpu"}, resources={"TPU": 2},
                          labels={"ray.io/tpu-worker-id": "0"})),
            # Slice 2, one v4-8 host whose TPU_WORKER_ID=1 (so Ray gives it no
            # head resource), labelled worker 0 and pod type v4-16 by hand.
            ((2, 0), dict(topology=Topology.parse("2x2x1", "TPU-V4"), env={"TPU_WORKER_ID": "1"},
                          resources={"TPU-v4-8-head": None},
                          labels={"ray.io/tpu-worker-id": "0", "ray.io/tpu-pod-type": "v4-16"})),
            # Slice 3, one v7x host started without RAY_TPU_RESOURCE_PER_CHIP=2:
            # Ray counts its 4 chips as 4 TPU resources, not 8.
            ((3, 0), dict(topology=Topology.parse("2x2x1", "TPU-V7X"), env={"RAY_TPU_RESOURCE_PER_CHIP": None},
                          resources={"TPU": 4})),
        ]:
            # Each its own lockfile stand-in: /tmp/libtpu_lockfile is this machine's,
            # and any process here may hold it.
            own = {SIMULATE_LIBTPU_LOCKFILE: str(locks / f"libtpu_lockfile_{key[0]}_{key[1]}")}
            cluster.add_host(*key, **{**kwargs, "env": {**own, **kwargs.get("env", {})}})
            added.append(key)
        cluster.cluster.wait_for_nodes(timeout=60)
        yield cluster
    finally:
        for key in added:
            cluster.remove_host(*key)
        os.close(lock)  # releases the lock


def test_every_fault_is_reported_and_exits_1(faults):
    proc = subprocess.run(
        [sys.executable, "-m", "ray_train_tpu", "doctor", "--address", faults.address, "--format", "json",
         "--timeout", TIMEOUT],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    found = {(p["check"], p["ip"] or p["slice"]) for p in report["problems"]}
    assert found == {
        ("lockfile_held", "127.0.1.2"),
        ("torch_tpu_missing", "127.0.2.1"),
        ("libtpu_missing", "127.0.2.2"),
        ("duplicate_worker_id", "sim-slice-1"),
        ("missing_host", "sim-slice-1"),
        ("chip_count_mismatch", "sim-slice-1"),
        ("topology_chips_mismatch", "127.0.2.2"),
        ("env_label_mismatch", "127.0.2.2"),
        ("missing_head_resource", "sim-slice-2"),
        ("pod_type_mismatch", "sim-slice-2"),
        ("env_label_mismatch", "127.0.3.1"),
        ("resource_per_chip", "127.0.4.1"),
    }, json.dumps(report["problems"], indent=1)
    held = next(p for p in report["problems"] if p["check"] == "lockfile_held")
    assert f"held by process {os.getpid()}" in held["message"]
    assert [s["name"] for s in report["slices"]] == [f"sim-slice-{i}" for i in range(4)]
    v7x = next(h for h in report["hosts"] if h["ip"] == "127.0.4.1")
    assert (v7x["chips"], v7x["tpu_resources"]) == (4, 4)
