"""TPUTorchConfig on a simulated v4 2x2x2 slice (2 hosts x 4 chips).

One cluster for the module. Host 1 registers with Ray before host 0, so rank
order that followed registration order would be wrong.
"""

import json
import os
import socket
import time
from pathlib import Path

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig, setup_process_group, shutdown_process_group
from ray_train_tpu.cli.plan import build_plan, worker_env
from ray_train_tpu.launch_env import ENV_KEYS
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL = "2x2x2", "TPU-V4"


# The GCS notices a removed host in ~3 s (default ~30 s), so that the host put in its
# place is not one of two that claim one TPU worker id (a broken slice to reserve).
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
SIMULATED_SLICE = dict(topology=TOPOLOGY, accelerator_type=ACCEL, host_order=[1, 0], system_config=HEALTH)


def _probe(config):
    """Train loop: every worker writes what it sees."""
    import torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    total = torch.tensor([float(dist.get_rank() + 1)], device=ray.train.torch.get_device())
    dist.all_reduce(total)
    try:  # a host tensor in the job's group: tpu_dist serves the device only, on a TPU too
        dist.all_reduce(torch.ones(1))
        host_error = None
    except RuntimeError as e:
        host_error = str(e)
    record = {
        "world_rank": ctx.get_world_rank(),
        "local_rank": ctx.get_local_rank(),
        "node_rank": ctx.get_node_rank(),
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "node_ip": ray.util.get_node_ip_address(),
        "device": str(ray.train.torch.get_device()),
        "sum": total.item(),
        "host_error": host_error,
        "env": {k: os.environ.get(k) for k in ENV_KEYS + ("RAY_TRAIN_TPU_SIMULATE", "TPU_SKIP_MDS_QUERY")},
    }
    Path(config["out"], f"{ctx.get_world_rank()}.json").write_text(json.dumps(record))


def _fit(train_fn, tmp_path, torch_config=None, scaling_config=None, name="run"):
    out = tmp_path / name
    out.mkdir()
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"out": str(out)},
        scaling_config=scaling_config or TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        torch_config=torch_config or TPUTorchConfig(),
        run_config=ray.train.RunConfig(
            storage_path=str(tmp_path / "storage"), name=name, failure_config=ray.train.FailureConfig(max_failures=0)
        ),
    )
    result = trainer.fit()
    return result, [json.loads(p.read_text()) for p in sorted(out.glob("*.json"), key=lambda p: int(p.stem))]


@pytest.fixture(scope="module")
def probe(sim, tmp_path_factory):
    result, records = _fit(_probe, tmp_path_factory.mktemp("probe"))
    assert result.error is None
    return records


def test_every_worker_env_is_what_plan_gives(sim, probe):
    assert len(probe) == 8
    hosts = [sim.hosts[(0, 0)], sim.hosts[(0, 1)]]
    env0 = probe[0]["env"]
    plan = build_plan(
        Topology.parse(TOPOLOGY, ACCEL),
        hosts=hosts,
        xprof_session_id=env0["TORCH_TPU_XPROF_SESSION_ID"],
        master_port=int(env0["MASTER_PORT"]),
    )
    for record in probe:
        rank = record["world_rank"]
        expected = worker_env(plan, rank)
        assert {k: record["env"][k] for k in ENV_KEYS} == expected


def test_all_rank_views_agree_and_follow_tpu_worker_id(sim, probe):
    for r in probe:
        env = r["env"]
        assert r["world_rank"] == r["dist_rank"] == int(env["RANK"])
        assert r["local_rank"] == int(env["LOCAL_RANK"]) == int(env["TPU_VISIBLE_CHIPS"])
        assert r["node_rank"] == int(env["NODE_RANK"]) == int(env["TPU_WORKER_ID"])
        assert r["node_ip"] == sim.hosts[(0, r["node_rank"])]
        assert int(env["RANK"]) == r["node_rank"] * 4 + r["local_rank"]
        assert r["dist_world"] == 8


def test_slicebuilder_addresses_are_shared_and_own_host(probe):
    lists = {r["env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"] for r in probe}
    assert len(lists) == 1
    addresses = lists.pop().split(",")
    for r in probe:
        assert addresses[r["dist_rank"]] == f"{r['node_ip']}:{8070 + r['local_rank']}"
    assert {r["env"]["TORCH_TPU_XPROF_SESSION_ID"] for r in probe} != {None}
    assert len({r["env"]["TORCH_TPU_XPROF_SESSION_ID"] for r in probe}) == 1


def test_all_reduce_on_the_simulated_tpu_device_over_tpu_dist(probe):
    for r in probe:
        assert r["sum"] == sum(range(1, 9))
        assert r["backend"] == "tpu_dist" and r["device"] == "tpu"
        assert "No backend type associated with device type cpu" in r["host_error"]
        assert r["env"]["RAY_TRAIN_TPU_SIMULATE"] == "1" and r["env"]["TPU_SKIP_MDS_QUERY"] == "1"


def test_nothing_left_after_fit(sim, probe):
    _assert_released()
    # nothing listens on the rendezvous port or any slice-builder port any more
    # (SO_REUSEADDR: connections of the finished run may linger in TIME_WAIT)
    master = probe[0]["env"]
    for host, port in [(master["MASTER_ADDR"], int(master["MASTER_PORT"]))] + [
        tuple(a.split(":")) for a in master["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    ]:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))


def test_two_chips_per_worker_is_refused_before_training(sim, tmp_path):
    scaling = ray.train.ScalingConfig(
        use_tpu=True, topology=TOPOLOGY, accelerator_type=ACCEL, num_workers=4, resources_per_worker={"TPU": 2}
    )
    with pytest.raises(Exception, match=r"exactly one TPU device per worker.*holds 2 TPU device"):
        _fit(_probe, tmp_path, scaling_config=scaling, name="two_chips")
    assert not list((tmp_path / "two_chips").glob("*.json"))  # the loop never ran
    _assert_released()


def _assert_released(timeout_s=30):
    """No Train worker alive, no placement group held."""
    from ray_train_tpu.testing import alive_actors

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        workers = [a for a in alive_actors() if a["class_name"] == "RayTrainWorker"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not workers and not groups:
            return
        time.sleep(1)
    assert workers == [] and groups == []


@ray.remote(resources={"TPU": 1}, num_cpus=0)
class _Actor:
    def all_reduce(self):
        import torch
        import torch.distributed as dist

        import ray_train_tpu

        t = torch.ones(1, device=ray_train_tpu.get_device()) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t.item(), int(os.environ["RANK"]), int(os.environ["TPU_WORKER_ID"]), str(t.device)


def test_seed_example_all_reduce_over_plain_actors(sim):
    actors = [_Actor.remote() for _ in range(8)]
    try:
        ordered = setup_process_group(actors)
        results = ray.get([a.all_reduce.remote() for a in ordered])
        assert [r[1] for r in results] == list(range(8))  # returned in rank order
        assert [r[2] for r in results] == [0] * 4 + [1] * 4
        assert all(r[0] == 36.0 and r[3] == "tpu:0" for r in results)
        shutdown_process_group(ordered)
    finally:
        for a in actors:
            ray.kill(a)


def test_tpu_host_without_tpu_device_fails_naming_what_is_missing(sim):
    real = _Actor.options(runtime_env={"env_vars": {"RAY_TRAIN_TPU_SIMULATE": "0"}})
    actors = [real.remote() for _ in range(8)]
    try:
        with pytest.raises(ray.exceptions.RayError) as e:
            setup_process_group(actors)
        msg = str(e.value)
        assert 'registered no the "tpu" device' not in msg
        assert 'registered no "tpu" device and no "tpu_dist" process-group backend' in msg
        assert "no TPU chip is visible" in msg and "never falls back to CPU" in msg
    finally:
        for a in actors:
            ray.kill(a)


def _replace_host(sim, key, **kwargs):
    """Remove a host and start another in its place once the GCS has seen the first go."""
    gone = sim.hosts[key]
    sim.remove_host(*key)
    deadline = time.monotonic() + 30
    while any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == gone):
        assert time.monotonic() < deadline, "the GCS never noticed the removed host"
        time.sleep(0.5)
    sim.add_host(*key, **kwargs)


def test_host_that_never_joins_fails_within_timeout_naming_it(sim, tmp_path):
    _replace_host(sim, (0, 1), stall_s=3600)
    try:
        start = time.time()
        with pytest.raises(Exception) as e:
            _fit(_probe, tmp_path, torch_config=TPUTorchConfig(rendezvous_timeout_s=10), name="stall")
        elapsed = time.time() - start
        msg = str(e.value)
        assert "4 of 8 workers did not answer the roll call" in msg and "ranks 4-7" in msg
        assert sim.hosts[(0, 1)] in msg and "rendezvous_timeout_s=10" in msg
        print(f"stalled host: fit() failed after {elapsed:.0f} s")
        assert elapsed < 120, elapsed
        _assert_released()
    finally:
        _replace_host(sim, (0, 1))
