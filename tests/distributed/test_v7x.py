"""v7x end to end: a simulated 2x2x1 slice (one host, 4 chips, 8 TensorCores),
two workers per chip (``RAY_TPU_RESOURCE_PER_CHIP=2``, ``{"TPU": 1}`` per core).

One `fit()`: every worker holds one of Ray's TPU ids 0..7, joins the process
group, and has exactly the environment of the statement
(`ray_train_tpu.testing.worker_env`): torch_tpu's per-process view with a
TensorCore per process (``TPU_VISIBLE_CHIPS`` = LOCAL_RANK, bounds
``2,2,1,2`` / ``1,1,1,1``), not Ray's physical-chip mask; what torch_tpu sets
at PJRT start agrees with it. A single-host slice asks no chip coordinates and
logs no word about host order.
"""

import json
import os
from pathlib import Path

import pytest
import ray
import ray.train

from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer
from ray_train_tpu.testing.worker_env import in_scope, statement, torch_tpu_sets
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL = "2x2x1", "TPU-V7X"
SIMULATED_SLICE = dict(topology=TOPOLOGY, accelerator_type=ACCEL)


def _loop(config):
    import torch
    import torch.distributed as dist

    import ray_train_tpu

    ctx = ray.train.get_context()
    device = ray_train_tpu.get_device()
    total = torch.tensor([float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(total)
    torch.manual_seed(0)
    model = ray_train_tpu.prepare_model(torch.nn.Linear(4, 1))  # DDP over the 8 TensorCores
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.randn(8, 4).to(device) * (dist.get_rank() + 1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = [torch.zeros_like(model.module.weight) for _ in range(dist.get_world_size())]
    dist.all_gather(weights, model.module.weight.detach())
    record = {"rank": ctx.get_world_rank(), "ip": ray.util.get_node_ip_address(), "sum": total.item(),
              "replicas_equal": all(torch.equal(w, weights[0]) for w in weights), "device": str(device),
              "tpu_ids": ray.get_runtime_context().get_accelerator_ids()["TPU"],
              "scope": {k: v for k, v in os.environ.items() if in_scope(k)}}
    Path(config["out"], f"{ctx.get_world_rank()}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def fit(sim, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v7x")
    trainer = TPUTorchTrainer(
        _loop, train_loop_config={"out": str(tmp)},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        run_config=ray.train.RunConfig(storage_path=str(tmp / "storage"), name="v7x",
                                       failure_config=ray.train.FailureConfig(max_failures=0)),
    )
    result = trainer.fit()
    assert result.error is None, result.error
    return [json.loads(p.read_text()) for p in sorted(tmp.glob("*.json"), key=lambda p: int(p.stem))]


def test_two_workers_per_chip_one_per_tensorcore(sim, fit):
    t = Topology.parse(TOPOLOGY, ACCEL)
    assert (t.num_chips, t.devices_per_chip, len(fit)) == (4, 2, 8)
    assert sorted(r["tpu_ids"][0] for r in fit) == [str(i) for i in range(8)]
    for r in fit:
        assert len(r["tpu_ids"]) == 1 and int(r["scope"]["LOCAL_RANK"]) == int(r["tpu_ids"][0]) == r["rank"]
        assert r["sum"] == sum(range(1, 9))  # the all_reduce over all 8
        assert r["replicas_equal"] and r["device"] == "tpu"  # DDP trained on the simulated device


def test_every_worker_env_is_the_statement(sim, fit):
    t = Topology.parse(TOPOLOGY, ACCEL)
    host = sim.host_env((0, 0))
    assert host["TPU_ACCELERATOR_TYPE"] == "tpu7x-8" and host["RAY_TPU_RESOURCE_PER_CHIP"] == "2"  # GKE's spelling
    env0 = fit[0]["scope"]
    for r in fit:
        stated = statement(t, [r["ip"]], rank=r["rank"], master_port=int(env0["MASTER_PORT"]),
                           session=env0["TORCH_TPU_XPROF_SESSION_ID"], host_env=host, simulated=True)
        expected = {k: v.value for k, v in stated.items() if v.value is not None}
        assert r["scope"] == expected, (r["rank"], set(r["scope"].items()) ^ set(expected.items()))
        # one TensorCore per process: Ray masked the physical chip (id // 2); torch_tpu's mask is the core
        assert r["scope"]["TPU_VISIBLE_CHIPS"] == str(r["rank"]) and r["scope"]["TORCH_TPU_TOPOLOGY"] == "2,2,1,2"
        derived = torch_tpu_sets(r["scope"])
        assert all(derived[k] == r["scope"][k] for k in derived if k in r["scope"])
        assert derived["CLOUD_TPU_TASK_ID"] == str(r["rank"]) and derived["TPU_PROCESS_PORT"] == str(8070 + r["rank"])


def test_a_single_host_slice_says_nothing_about_host_order(sim, fit):
    logs = Path(sim.cluster.head_node.get_session_dir_path(), "logs")
    text = "\n".join(p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file()
                     and p.suffix in (".err", ".out", ".log"))
    assert "TPU_WORKER_ID order" not in text and "chip coordinates" not in text
    assert "no TPU chip coordinates" not in text  # nobody asked: one host has nothing to order
