"""Two simulated slices (v4 2x2x1: one host of 4 chips each), connected "over DCN".

Ranks are slice-major; each slice keeps its own slice-builder addresses; the
MegaScale variables name the coordinator on slice 0's first host and each
worker's slice; an all_reduce spans both slices.
"""

import json
import os
from pathlib import Path

import pytest
import ray
import ray.train
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
from ray_train_tpu.cli.plan import build_plan, worker_env
from ray_train_tpu.launch_env import ENV_KEYS, MEGASCALE_KEYS
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed


SIMULATED_SLICE = dict(topology="2x2x1", accelerator_type="TPU-V4", num_slices=2)


def _probe(config):
    import torch
    import torch.distributed as dist

    import ray_train_tpu

    ctx = ray.train.get_context()
    t = torch.tensor([1.0], device=ray_train_tpu.get_device())
    dist.all_reduce(t)
    Path(config["out"], f"{ctx.get_world_rank()}.json").write_text(json.dumps({
        "rank": ctx.get_world_rank(), "node_rank": ctx.get_node_rank(), "ip": ray.util.get_node_ip_address(),
        "slice": os.environ["TPU_NAME"], "sum": t.item(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS + MEGASCALE_KEYS},
    }))


def test_two_slices_env_and_all_reduce(sim, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = TorchTrainer(
        _probe,
        train_loop_config={"out": str(out)},
        scaling_config=TPUScalingConfig(topology="2x2x1", accelerator_type="TPU-V4", num_slices=2),
        torch_config=TPUTorchConfig(),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "s"), failure_config=ray.train.FailureConfig(max_failures=0)),
    ).fit()
    assert result.error is None
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert sorted(r["rank"] for r in records) == list(range(8))
    hosts = [sim.hosts[(0, 0)], sim.hosts[(1, 0)]]
    env0 = next(r for r in records if r["rank"] == 0)["env"]
    plan = build_plan(Topology.parse("2x2x1", "TPU-V4"), num_slices=2, hosts=hosts,
                      xprof_session_id=env0["TORCH_TPU_XPROF_SESSION_ID"], master_port=int(env0["MASTER_PORT"]))
    for r in records:
        assert r["sum"] == 8.0
        assert r["env"] == worker_env(plan, r["rank"])
        slice_id = r["rank"] // 4
        assert r["slice"] == f"sim-slice-{slice_id}" and r["ip"] == hosts[slice_id]
        assert r["env"]["MEGASCALE_SLICE_ID"] == str(slice_id) and r["env"]["MEGASCALE_NUM_SLICES"] == "2"
        assert r["env"]["MEGASCALE_COORDINATOR_ADDRESS"] == f"{hosts[0]}:8080"
        assert r["env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[r["rank"] % 4] == f"{hosts[slice_id]}:{8070 + r['rank'] % 4}"
        assert r["node_rank"] == slice_id == int(r["env"]["NODE_RANK"])


def _ddp_loop(config):
    import torch
    import torch.distributed as dist

    import ray_train_tpu

    torch.manual_seed(0)
    model = ray_train_tpu.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 4).to(ray_train_tpu.get_device()) * (dist.get_rank() + 1)  # different data per rank
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = model.module.weight.detach().clone()
    gathered = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, w)
    if dist.get_rank() == 0:
        Path(config["out"]).write_text(json.dumps({
            "replicas_equal": all(torch.equal(g, gathered[0]) for g in gathered),
            "world_size": dist.get_world_size()}))


def test_short_ddp_run_across_two_slices_keeps_replicas_identical(sim, tmp_path):
    from ray_train_tpu import TPUTorchTrainer

    out = tmp_path / "ddp.json"
    result = TPUTorchTrainer(
        _ddp_loop,
        train_loop_config={"out": str(out)},
        scaling_config=TPUScalingConfig(topology="2x2x1", accelerator_type="TPU-V4", num_slices=2),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), failure_config=ray.train.FailureConfig(max_failures=0)),
    ).fit()
    assert result.error is None
    metrics = json.loads(out.read_text())
    assert metrics["replicas_equal"] is True and metrics["world_size"] == 8
    from ray_train_tpu.strategies import get_strategy

    layout = get_strategy("fsdp2").validate(Topology.parse("2x2x1", "TPU-V4"), num_slices=2, world_size=8)
    assert layout.dim_names[0] == "dp_replicate" and layout.shape[0] == 2  # slices outermost (HSDP)
