"""Exact resume after a worker failure, on a simulated v4 2x2x1 slice (1 host, 4 workers).

Each run trains a tiny model with dropout over a rank-sharded StatefulDataLoader
for STEPS steps (3 epochs), checkpointing every step with
`ray_train_tpu.checkpoint.report`. Rank 1 exits after step FAIL_AFTER (once: a
marker file), Ray Train restarts the worker group (FailureConfig(max_failures=1)),
and the run resumes from the last checkpoint Ray registered. Then the same
workers train again from scratch without any checkpointing: the uninterrupted
reference. Final parameters, optimizer state and the losses of every step after
the resume must be bitwise equal.

Not tested here: losing the whole slice (SimulatedTPUCluster.remove_host/add_host
during fit()); in a trial the re-added host did not register and Ray's
controller retried the slice reservation every 60 s without end.
"""

import json
import os
import time
from pathlib import Path

import pytest
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
from ray_train_tpu.checkpoint import MANIFEST
from ray_train_tpu.testing import simulated_tpu_cluster

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL, WORLD = "2x2x1", "TPU-V4", 4
STEPS, FAIL_AFTER = 6, 3  # 2 batches per rank and epoch


@pytest.fixture(scope="module")
def sim():
    with simulated_tpu_cluster(TOPOLOGY, ACCEL) as cluster:
        yield cluster


def _build(strategy, rank):
    """Model (seed 0, then wrapped), optimizer, scheduler and loader, as every run builds them."""
    import torch
    from torch import nn

    import ray_train_tpu
    from ray_train_tpu.data import stateful_dataloader

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)).to(ray_train_tpu.get_device())
    if strategy == "ddp":
        # DDP rebuilds its gradient buckets after its first iteration, so a
        # restarted DDP would sum its first step in another order (last-bit
        # differences with > 2 ranks); find_unused_parameters=True never rebuilds.
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 2, generator=g))
    loader = stateful_dataloader(data, batch_size=6, seed=11)
    torch.manual_seed(1000 + rank)  # dropout: a stream per rank, restored per rank
    return model, opt, sched, loader


def _run(config, rank, checkpointing):
    """Train to STEPS; with checkpointing, resume from Ray's checkpoint and report
    one every step. Returns the full final state and {step: loss} of this attempt."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    from ray_train_tpu import checkpoint

    out = Path(config["out"])
    model, opt, sched, loader = _build(config["strategy"], rank)
    info = checkpoint.restore(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader) if checkpointing else None
    step, epoch, losses = (0 if info is None else info.step), loader.epoch, {}
    if checkpointing and rank == 0:
        with open(out / "attempts.jsonl", "a") as f:
            f.write(json.dumps({"resumed_from": None if info is None else info.step}) + "\n")
    while step < STEPS:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            losses[step] = loss.item()
            if checkpointing:
                checkpoint.report({"loss": loss.item()}, model=model, optimizer=opt, lr_scheduler=sched,
                                  dataloader=loader, step=step, extra={"epoch": epoch})
                if step == config.get("fail_after") and rank == 1 and not (out / "failed").exists():
                    (out / "failed").touch()
                    os._exit(1)
            if step == STEPS:
                break
        epoch += 1
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, opt, options=full)}, losses


def _train(config):
    """The resumable run (which may fail once), then, in the same workers, an
    uninterrupted reference run from scratch that never checkpoints."""
    import torch

    rank = ray.train.get_context().get_world_rank()
    resumed, losses = _run(config, rank, checkpointing=True)
    reference, reference_losses = _run(config, rank, checkpointing=False)
    if rank == 0:
        torch.save({"resumed": resumed, "losses": losses, "reference": reference,
                    "reference_losses": reference_losses}, Path(config["out"]) / "final.pt")


def _fit(tmp_path, name, strategy, fail_after=None):
    out = tmp_path / name
    out.mkdir()
    trainer = TorchTrainer(
        _train,
        train_loop_config={"out": str(out), "strategy": strategy, "fail_after": fail_after},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        torch_config=TPUTorchConfig(),
        run_config=ray.train.RunConfig(
            storage_path=str(tmp_path / "storage"), name=name, failure_config=ray.train.FailureConfig(max_failures=1)
        ),
    )
    start = time.time()
    result = trainer.fit()
    assert result.error is None, result.error
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    return dict(result=result, attempts=attempts, seconds=time.time() - start, out=out, **torch.load(out / "final.pt"))


def _assert_bitwise_equal(a, b, where="final"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_after_worker_failure_is_bitwise_exact(sim, tmp_path, strategy):
    run = _fit(tmp_path, strategy, strategy, fail_after=FAIL_AFTER)
    print(f"{strategy}: {run['seconds']:.0f} s")
    assert (run["out"] / "failed").exists()
    _assert_exact_resume(run)


def _assert_exact_resume(run):
    assert len(run["attempts"]) == 2, run["attempts"]
    resumed_from = run["attempts"][1]["resumed_from"]
    # Ray registers a step's checkpoint once it has collected every rank's report
    # of it; reports not yet collected when a worker dies are lost, so the run
    # may resume a step or two before FAIL_AFTER (seen: 3 with FAIL_AFTER 5).
    assert run["attempts"][0] == {"resumed_from": None} and 1 <= resumed_from <= FAIL_AFTER
    assert sorted(run["losses"]) == list(range(resumed_from + 1, STEPS + 1))
    assert run["losses"] == {k: v for k, v in run["reference_losses"].items() if k > resumed_from}
    _assert_bitwise_equal(run["resumed"], run["reference"])
    assert run["resumed"]["optim"]["state"]["0.weight"]["step"].item() == STEPS
    ckpt = Path(run["result"].checkpoint.path)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["step"] == STEPS and manifest["world_size"] == WORLD and manifest["extra"] == {"epoch": 2}
    names = {p.name for p in ckpt.iterdir()}
    assert {f"rank{r:05d}.pt" for r in range(WORLD)} | {".metadata", MANIFEST} <= names
    assert set(manifest["files"]) <= names
