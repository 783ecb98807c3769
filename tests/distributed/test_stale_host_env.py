"""Hosts that carry TorchTPU variables of something else: a GKE webhook's (ports 8471+,
DNS names), a JAX-style launcher's (one address per host), another slice's hostnames, a
wrong topology, and a MegaScale coordinator of a job that is gone. Two simulated v4
2x2x2 slices (2 hosts x 4 chips each): slice 0 on GKE, slice 1 on TPU VMs started
with ``ray start`` (no GKE variable: Ray names them from their GCE metadata, and so
does our backend, from Ray's node labels).

Every worker must see exactly what `launch_envs` computes for the live worker group,
single- and multi-slice and again on a retry; a MegaScale variable a single-slice job
does not use is removed; an `extra_env` override that cannot describe the slice fails
before the training loop, naming the variable. Last, one host of slice 0 is killed
hard: a job must then reserve slice 1, never the broken slice's surviving head
(`_compat.ray_tpu`, docs/elastic.md).
"""

import json
import os
from pathlib import Path

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
from ray_train_tpu.launch_env import ENV_KEYS, JOB_KEYS, launch_envs
from ray_train_tpu.testing import simulated_tpu_cluster
from ray_train_tpu.testing.simulated_cluster import host_ip
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL = "2x2x2", "TPU-V4"
WEBHOOK = {  # kuberay-tpu-webhook style: DNS names, ports 8471+
    "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"w-{h}.tpu-svc:{8471 + i}" for h in range(2) for i in range(4)),
    "TPU_WORKER_HOSTNAMES": "w-0.tpu-svc,w-1.tpu-svc",
    "TORCH_TPU_TOPOLOGY": "2x2x2",
}
JAX_STYLE = {  # one address per host, a wrong topology
    "TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.9.9.1:8476,10.9.9.2:8476",
    "TORCH_TPU_TOPOLOGY": "4,4,1",
}
STALE = {  # an earlier slice and a multi-slice job that is gone
    "TPU_WORKER_HOSTNAMES": "10.8.0.1,10.8.0.2",
    "MASTER_ADDR": "10.8.0.1",
    "MEGASCALE_COORDINATOR_ADDRESS": "10.8.0.1:8081",
    "MEGASCALE_NUM_SLICES": "4",
    "MEGASCALE_SLICE_ID": "3",
}
HOST_ENV = {(0, 0): WEBHOOK, (0, 1): JAX_STYLE, (1, 0): STALE, (1, 1): {**WEBHOOK, **STALE}}
TPU_VMS = [(1, 0), (1, 1)]
# The GCS notices a killed host in ~3 s (default ~15 s).
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def sim():
    with simulated_tpu_cluster(TOPOLOGY, ACCEL, num_slices=2, host_env=HOST_ENV, tpu_vm=TPU_VMS,
                               system_config=HEALTH) as cluster:
        yield cluster


def _record(config):
    import torch
    import torch.distributed as dist

    import ray_train_tpu

    ctx = ray.train.get_context()
    total = torch.tensor([1.0], device=ray_train_tpu.get_device())
    dist.all_reduce(total)
    out = Path(config["out"])
    attempt = len(list(out.glob(f"{ctx.get_world_rank()}.*.json")))
    record = {"host": ray.util.get_node_ip_address(), "sum": total.item(), "tpu_name": os.environ.get("TPU_NAME"),
              "env": {k: os.environ[k] for k in JOB_KEYS if k in os.environ}}
    (out / f"{ctx.get_world_rank()}.{attempt}.json").write_text(json.dumps(record))
    if config.get("fail_once") and ctx.get_world_rank() == 0 and attempt == 0:
        raise RuntimeError("planned failure of the first attempt")


def _fit(tmp_path, name, num_slices=1, fail_once=False, extra_env=None, max_failures=1):
    out = tmp_path / name
    out.mkdir()
    trainer = TorchTrainer(
        _record,
        train_loop_config={"out": str(out), "fail_once": fail_once},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL, num_slices=num_slices),
        torch_config=TPUTorchConfig(extra_env=extra_env or {}),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "storage"), name=name,
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures)),
    )
    result = trainer.fit()
    records = {}
    for path in out.glob("*.json"):
        rank, attempt = map(int, path.name.split(".")[:2])
        records.setdefault(attempt, {})[rank] = json.loads(path.read_text())
    return result, records


def _assert_live_env(sim, records, num_slices):
    """Every worker's job variables are exactly those computed for the hosts it runs on."""
    world = 8 * num_slices
    assert sorted(records) == list(range(world))
    hosts = [records[r]["host"] for r in range(0, world, 4)]  # rank order: 4 chips per host
    slice_ids = {sim.slice_names.index(_slice_of(sim, h)) for h in hosts}
    assert len(slice_ids) == num_slices
    session = records[0]["env"]["TORCH_TPU_XPROF_SESSION_ID"]
    computed = launch_envs(Topology.parse(TOPOLOGY, ACCEL), hosts, num_slices=num_slices, xprof_session_id=session,
                           master_port=int(records[0]["env"]["MASTER_PORT"]))
    for rank, (_, env) in enumerate(computed):
        assert records[rank]["env"] == env, rank  # nothing stale kept, no MegaScale on one slice
        assert records[rank]["sum"] == world


def _slice_of(sim, ip):
    return next(sim.slice_names[s] for (s, w), h in sim.hosts.items() if h == ip)


def test_multi_slice_job_recomputes_megascale(sim, tmp_path):
    result, attempts = _fit(tmp_path, "two", num_slices=2)
    assert result.error is None, result.error
    _assert_live_env(sim, attempts[0], 2)
    env0 = attempts[0][0]["env"]
    assert env0["MEGASCALE_NUM_SLICES"] == "2"
    assert env0["MEGASCALE_COORDINATOR_ADDRESS"].split(":")[0] == attempts[0][0]["host"]
    # slice 1's workers ran with no TPU_NAME: their place came from Ray's labels
    on_vms = [r for r in attempts[0].values() if _slice_of(sim, r["host"]) == "sim-slice-1"]
    assert len(on_vms) == 8 and all(r["tpu_name"] is None for r in on_vms)


def test_ray_names_the_tpu_vms_from_their_metadata(sim):
    """We gave slice 1's nodes no TPU label, slice or head resource: Ray derived them."""
    import ray

    nodes = {n["NodeManagerAddress"]: n for n in ray.nodes() if n["Alive"]}
    for (s, w) in TPU_VMS:
        node = nodes[sim.hosts[(s, w)]]
        assert "TPU_NAME" not in sim.host_env((s, w)) and "TPU_WORKER_ID" not in sim.host_env((s, w))
        assert {k: node["Labels"].get(k) for k in ("ray.io/tpu-slice-name", "ray.io/tpu-worker-id",
                                                   "ray.io/tpu-topology", "ray.io/tpu-pod-type")} == {
            "ray.io/tpu-slice-name": "sim-slice-1", "ray.io/tpu-worker-id": str(w),
            "ray.io/tpu-topology": TOPOLOGY, "ray.io/tpu-pod-type": "v4-16"}
        assert "sim-slice-1" in node["Resources"] and ("TPU-v4-16-head" in node["Resources"]) == (w == 0)


def test_single_slice_job_sees_only_the_live_slice_and_a_retry_recomputes_everything(sim, tmp_path):
    result, attempts = _fit(tmp_path, "retry", fail_once=True)
    assert result.error is None, result.error
    assert sorted(attempts) == [0, 1]
    for attempt in attempts.values():
        _assert_live_env(sim, attempt, 1)
        assert not any(k.startswith("MEGASCALE") for r in attempt.values() for k in r["env"])
    ids = {a[0]["env"]["TORCH_TPU_XPROF_SESSION_ID"] for a in attempts.values()}
    assert len(ids) == 2, "the retry reused the failed attempt's profiling session"


def test_a_wrong_override_fails_before_the_loop_naming_the_variable(sim, tmp_path):
    bad = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.9.9.1:8476,10.9.9.2:8476"}
    with pytest.raises(Exception, match="TORCH_TPU_SLICEBUILDER_ADDRESSES") as e:
        _fit(tmp_path, "bad", extra_env=bad, max_failures=0)
    assert "one address per device" in str(e.value)
    assert not list((tmp_path / "bad").glob("*.json")), "the training loop ran"


def test_a_job_reserves_the_intact_slice_not_a_broken_ones_head(sim, tmp_path):
    """Slice 0 loses worker 1 (killed hard); its worker 0, with its free head resource,
    lives on. Ray's reservation alone may take that head and wait out the worker
    group's start timeout; ours excludes slice 0. Last: it breaks the cluster."""
    import time

    sim.remove_host(0, 1)
    deadline = time.monotonic() + 30
    while any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == host_ip(0, 1)):
        assert time.monotonic() < deadline, "the GCS never noticed the killed host"
        time.sleep(0.5)
    from ray.util.tpu import SlicePlacementGroup

    from ray_train_tpu._compat import ray_tpu as compat_ray_tpu

    compat_ray_tpu.install_slice_reservation()  # here, as the backend does in Ray Train's controller
    for _ in range(6):  # Ray alone took the broken head in 3 of 6 (docs/elastic.md)
        spg = SlicePlacementGroup(topology=TOPOLOGY, accelerator_version="v4", head_reservation_timeout_s=20)
        try:
            ray.get(spg.placement_group.ready(), timeout=20)
            table = ray.util.placement_group_table(spg.placement_group)["bundles_to_node_id"]
            on = {n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] in set(table.values())}
            assert on == {sim.hosts[(1, 0)], sim.hosts[(1, 1)]}, on
        finally:
            spg.shutdown()
    result, attempts = _fit(tmp_path, "intact", max_failures=0)  # Ray Train's own reservation, on TPU VMs
    assert result.error is None, result.error
    assert {_slice_of(sim, r["host"]) for r in attempts[0].values()} == {"sim-slice-1"}
    assert all(r["tpu_name"] is None for r in attempts[0].values())

