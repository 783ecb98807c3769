"""Hosts that carry TorchTPU variables of something else: a GKE webhook's (ports 8471+,
DNS names), a JAX-style launcher's (one address per host), another slice's hostnames, a
wrong topology, and a MegaScale coordinator of a job that is gone. Two simulated v4
2x2x2 slices (2 hosts x 4 chips each).

Every worker must see exactly what `launch_envs` computes for the live worker group,
single- and multi-slice and again on a retry; a MegaScale variable a single-slice job
does not use is removed; an `extra_env` override that cannot describe the slice fails
before the training loop, naming the variable.
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


@pytest.fixture(scope="module")
def sim():
    with simulated_tpu_cluster(TOPOLOGY, ACCEL, num_slices=2, host_env=HOST_ENV) as cluster:
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
    record = {"host": ray.util.get_node_ip_address(), "sum": total.item(),
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


def test_single_slice_job_sees_only_the_live_slice(sim, tmp_path):
    result, attempts = _fit(tmp_path, "one")
    assert result.error is None, result.error
    _assert_live_env(sim, attempts[0], 1)
    assert not any(k.startswith("MEGASCALE") for r in attempts[0].values() for k in r["env"])


def test_multi_slice_job_recomputes_megascale(sim, tmp_path):
    result, attempts = _fit(tmp_path, "two", num_slices=2)
    assert result.error is None, result.error
    _assert_live_env(sim, attempts[0], 2)
    env0 = attempts[0][0]["env"]
    assert env0["MEGASCALE_NUM_SLICES"] == "2"
    assert env0["MEGASCALE_COORDINATOR_ADDRESS"].split(":")[0] == attempts[0][0]["host"]


def test_a_retry_recomputes_everything(sim, tmp_path):
    result, attempts = _fit(tmp_path, "retry", fail_once=True)
    assert result.error is None, result.error
    assert sorted(attempts) == [0, 1]
    for attempt in attempts.values():
        _assert_live_env(sim, attempt, 1)
    ids = {a[0]["env"]["TORCH_TPU_XPROF_SESSION_ID"] for a in attempts.values()}
    assert len(ids) == 2, "the retry reused the failed attempt's profiling session"


def test_a_wrong_override_fails_before_the_loop_naming_the_variable(sim, tmp_path):
    bad = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.9.9.1:8476,10.9.9.2:8476"}
    with pytest.raises(Exception, match="TORCH_TPU_SLICEBUILDER_ADDRESSES") as e:
        _fit(tmp_path, "bad", extra_env=bad, max_failures=0)
    assert "one address per device" in str(e.value)
    assert not list((tmp_path / "bad").glob("*.json")), "the training loop ran"
