"""Rank order from physical chip coordinates on a simulated v4 2x2x4 slice
(4 hosts x 4 chips, hosts stacked along Z), and every worker's whole environment.

The hosts' TPU_WORKER_IDs are shuffled and one is repeated (as GKE has handed
them out: Ray#66029, ai-on-gke#858); each host's libtpu (simulated) reports its
chips' physical coordinates to torch_tpu's query, run once per host with the
whole host's view. Ranks, NODE_RANK, TPU_WORKER_HOSTNAMES and the slice-builder
addresses must follow the coordinates (torch_tpu's Z-major host order), in Ray
Train and over plain actors, and the backend must name every host whose id it
overrules. Every worker's environment when the loop starts must be the
statement of `ray_train_tpu.testing.worker_env` (docs/environment.md), and
before our backend runs, what Ray 2.60's own code made of the host's.
"""

import json
import os
from pathlib import Path

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig, setup_process_group, shutdown_process_group
from ray_train_tpu.launch_env import ENV_KEYS, launch_envs
from ray_train_tpu.testing import simulated_tpu_cluster
from ray_train_tpu.testing.worker_env import in_scope, statement, torch_tpu_sets
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL = "2x2x4", "TPU-V4"
# (slice id, registration index) -> chip coordinates of the host's first chip, and its TPU_WORKER_ID
COORDS = {(0, 0): (0, 0, 2), (0, 1): (0, 0, 0), (0, 2): (0, 0, 3), (0, 3): (0, 0, 1)}
WORKER_IDS = {(0, 0): "3", (0, 1): "2", (0, 2): "3", (0, 3): "1"}  # shuffled, 3 twice, no 0
BY_COORDS = [(0, 1), (0, 3), (0, 0), (0, 2)]  # position in the slice -> host, by Z


@pytest.fixture(scope="module")
def sim():
    assert Topology.parse(TOPOLOGY, ACCEL).num_hosts == 4
    host_env = {k: {"TPU_WORKER_ID": v} for k, v in WORKER_IDS.items()}
    # What importing libtpu in the driver sets (torch_tpu does, as the conformance
    # tests do earlier in a suite run): a host's environment must not inherit it.
    leak = "TPU_LIBRARY_PATH"
    saved = os.environ.get(leak)
    os.environ[leak] = "/driver/only/libtpu.so"
    try:
        with simulated_tpu_cluster(TOPOLOGY, ACCEL, host_env=host_env, host_coords=COORDS,
                                   host_order=[2, 0, 3, 1]) as c:
            yield c
    finally:
        if saved is None:
            os.environ.pop(leak, None)
        else:
            os.environ[leak] = saved


def _probe(config):
    import torch
    import torch.distributed as dist

    import ray_train_tpu

    ctx = ray.train.get_context()
    total = torch.tensor([float(dist.get_rank() + 1)], device=ray_train_tpu.get_device())
    dist.all_reduce(total)
    record = {"world_rank": ctx.get_world_rank(), "node_rank": ctx.get_node_rank(), "local_rank": ctx.get_local_rank(),
              "node_ip": ray.util.get_node_ip_address(), "sum": total.item(),
              "env": {k: os.environ.get(k) for k in ENV_KEYS},
              "scope": {k: v for k, v in os.environ.items() if in_scope(k)}}
    Path(config["out"], f"{ctx.get_world_rank()}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def probe(sim, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coords")
    trainer = TorchTrainer(
        _probe,
        train_loop_config={"out": str(tmp)},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        torch_config=TPUTorchConfig(),
        run_config=ray.train.RunConfig(storage_path=str(tmp / "storage"), name="coords",
                                       failure_config=ray.train.FailureConfig(max_failures=0)),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    return [json.loads(p.read_text()) for p in sorted(tmp.glob("*.json"), key=lambda p: int(p.stem))]


def _expected_hosts(sim):
    return [sim.hosts[k] for k in BY_COORDS]


def test_ranks_follow_coordinates_not_worker_ids(sim, probe):
    assert len(probe) == 16
    hosts = _expected_hosts(sim)
    for r in probe:
        assert r["node_ip"] == hosts[r["node_rank"]], r
        assert r["world_rank"] == r["node_rank"] * 4 + r["local_rank"] == int(r["env"]["RANK"])
        assert r["node_rank"] == int(r["env"]["NODE_RANK"]) == int(r["env"]["TPU_WORKER_ID"])
        assert r["sum"] == sum(range(1, 17))  # the all_reduce over all 16


def test_every_worker_env_is_launch_envs_for_the_coordinate_order(sim, probe):
    env0 = probe[0]["env"]
    computed = launch_envs(Topology.parse(TOPOLOGY, ACCEL), _expected_hosts(sim),
                           xprof_session_id=env0["TORCH_TPU_XPROF_SESSION_ID"], master_port=int(env0["MASTER_PORT"]))
    assert env0["TPU_WORKER_HOSTNAMES"] == ",".join(_expected_hosts(sim))
    for r in probe:
        assert r["env"] == computed[r["world_rank"]][1], r["world_rank"]


def test_the_backend_names_every_overruled_host(sim, probe):
    logs = Path(sim.cluster.head_node.get_session_dir_path(), "logs")
    text = "\n".join(p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file() and p.suffix in (".err", ".out", ".log"))
    lines = [l for l in text.splitlines() if "chip coordinates" in l and "it takes position" in l]
    for position, key in enumerate(BY_COORDS):
        named = [l for l in lines if f"host {sim.hosts[key]} of slice" in l]
        if key == (0, 3):  # TPU_WORKER_ID=1 at position 1: nothing to say
            assert not named, named
            continue
        assert named, (key, lines)
        assert f"TPU_WORKER_ID={WORKER_IDS[key]}" in named[0] and f"put it at position {position} " in named[0]


def _host_key(sim, ip):
    return next(k for k, h in sim.hosts.items() if h == ip)


def test_every_worker_env_is_the_statement(sim, probe):
    """The whole environment when the loop starts (torch_tpu would start here):
    nothing missing, nothing extra, every value as stated; and what torch_tpu
    sets at PJRT start from it agrees with it and forms one slice."""
    t = Topology.parse(TOPOLOGY, ACCEL)
    hosts = _expected_hosts(sim)
    env0 = probe[0]["scope"]
    tasks = set()
    for r in probe:
        stated = statement(t, hosts, rank=r["world_rank"], master_port=int(env0["MASTER_PORT"]),
                           session=env0["TORCH_TPU_XPROF_SESSION_ID"], host_env=sim.host_env(_host_key(sim, r["node_ip"])),
                           simulated=True)
        expected = {k: v.value for k, v in stated.items() if v.value is not None}
        assert r["scope"] == expected, (r["world_rank"], set(r["scope"].items()) ^ set(expected.items()))
        derived = torch_tpu_sets(r["scope"])
        assert all(derived[k] == r["scope"][k] for k in derived if k in r["scope"])  # no flip at PJRT start
        own = derived["TPU_PROCESS_ADDRESSES"].split(",")[int(derived["CLOUD_TPU_TASK_ID"])]
        assert own == f"{r['node_ip']}:{derived['TPU_PROCESS_PORT']}"
        tasks.add(derived["CLOUD_TPU_TASK_ID"])
    assert tasks == {str(i) for i in range(16)}


@ray.remote(resources={"TPU": 1}, num_cpus=0)
class _Actor:
    def ray_env(self):
        """What the worker has before our backend: the host's, and what Ray 2.60 set."""
        ids = ray.get_runtime_context().get_accelerator_ids()["TPU"]
        return ids, ray.util.get_node_ip_address(), {k: v for k, v in os.environ.items() if in_scope(k)}

    def all_reduce(self):
        import torch
        import torch.distributed as dist

        import ray_train_tpu

        t = torch.ones(1, device=ray_train_tpu.get_device()) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t.item(), int(os.environ["RANK"]), ray.util.get_node_ip_address()


def test_plain_actors_follow_the_same_order(sim, probe):
    actors = [_Actor.remote() for _ in range(16)]
    try:
        for ids, ip, env in ray.get([a.ray_env.remote() for a in actors]):
            # Ray 2.60's own TPUAcceleratorManager on the host's GKE variables: one chip, one host
            host = sim.host_env(_host_key(sim, ip))
            assert (env["TPU_VISIBLE_CHIPS"], env["TPU_CHIPS_PER_HOST_BOUNDS"], env["TPU_HOST_BOUNDS"]) == \
                (ids[0], "1,1,1", "1,1,1"), (ids, env)
            assert host["TPU_HOST_BOUNDS"] == "1,1,4" and host["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,2,1"
            changed = {k for k in env if env[k] != host.get(k)} - {"TPU_VISIBLE_CHIPS", "TPU_HOST_BOUNDS",
                                                                   "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_SKIP_MDS_QUERY"}
            assert changed == set(), changed  # the rest is the host's
            assert host["TPU_SKIP_MDS_QUERY"] == "true" and env["TPU_SKIP_MDS_QUERY"] == "1"  # GKE's; the job's
        ordered = setup_process_group(actors)
        results = ray.get([a.all_reduce.remote() for a in ordered])
        assert [r[1] for r in results] == list(range(16))
        assert [r[2] for r in results] == [h for h in _expected_hosts(sim) for _ in range(4)]
        assert all(r[0] == sum(range(1, 17)) for r in results)
        shutdown_process_group(ordered)
    finally:
        for a in actors:
            ray.kill(a)
