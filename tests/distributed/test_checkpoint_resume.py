"""Exact resume after a failure, on a simulated cluster of two v4 2x2x2 slices
(2 hosts and 8 workers each; a run takes one slice, the other is the spare).

Each run trains a tiny model with dropout over a rank-sharded StatefulDataLoader
for STEPS steps (3 epochs), checkpointing every step with
`ray_train_tpu.checkpoint.report`. Once (a marker file) the first attempt fails
at step FAIL_AFTER in one of two ways:

- "save" (FSDP2): rank 1 exits inside DCP's write of the step's checkpoint,
  before writing a byte; the survivors are left in DCP's collective;
- "host" (DDP): the driver removes TPU worker 1 of the slice in use from the
  cluster, as a preempted TPU VM; the survivors are left in the next step's
  collective.

(A third run, DDP with rank 1 exiting between steps, was cut for the suite's time
budget: it took ~80 s and its survivors wait in the same collective as the host
run's; the process exit itself is the "save" run's.)

Ray Train restarts the worker group (FailureConfig(max_failures=1)) and the
run resumes from the last checkpoint Ray registered. (A termination notice, on
Ray's own preemption path, is tested in test_elastic.py.) Then the same workers train
again from scratch without any checkpointing: the uninterrupted reference. Final
parameters, optimizer state and the losses of every step after the resume must
be bitwise equal; the failure must end the attempt long before the process
group's timeout; the restarted group must hold a whole slice and fresh
launch variables.
"""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
from ray_train_tpu.checkpoint import MANIFEST
from ray_train_tpu.cli.plan import build_plan, worker_env
from ray_train_tpu.launch_env import ENV_KEYS
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL, WORLD, SLICES = "2x2x2", "TPU-V4", 8, 2
STEPS, FAIL_AFTER = 6, 3  # 2 batches per rank and epoch
# The process group's timeout (TorchConfig.timeout_s): survivors of a failure
# must be stopped by Ray long before a collective would time out.
PG_TIMEOUT_S = 1800


SIMULATED_SLICE = dict(topology=TOPOLOGY, accelerator_type=ACCEL, num_slices=SLICES)


def _build(strategy, rank):
    """Model (seed 0, then wrapped), optimizer, scheduler and loader, as every run builds them."""
    import torch
    from torch import nn

    import ray_train_tpu
    from ray_train_tpu.data import stateful_dataloader

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)).to(ray_train_tpu.get_device())
    if strategy == "ddp":
        # The default DDPStrategy, no flags: its gradient buckets are fixed before
        # the first step, so the restarted DDP sums its first step in the same
        # order as the uninterrupted run (plain DDP rebuilds them after its first
        # step and differed in the last bits with > 2 ranks; issue 17, part 4).
        model = ray_train_tpu.prepare_model(model)
        assert type(model).__name__ == "FixedOrderDDP"
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g), torch.randn(96, 2, generator=g))
    loader = stateful_dataloader(data, batch_size=6, seed=11)
    torch.manual_seed(1000 + rank)  # dropout: a stream per rank, restored per rank
    return model, opt, sched, loader


def _run(config, rank, checkpointing):
    """Train to STEPS; with checkpointing, resume from Ray's checkpoint and report
    one every step. Returns the full final state and {step: loss} of this attempt."""
    return _train_steps(config, rank, checkpointing, Path(config["out"]), config.get("fail"))


def _train_steps(config, rank, checkpointing, out, fail):
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )

    import ray_train_tpu
    from ray_train_tpu import checkpoint
    from ray_train_tpu.launch_env import ENV_KEYS

    model, opt, sched, loader = _build(config["strategy"], rank)
    info = checkpoint.restore(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader) if checkpointing else None
    step, epoch, losses = (0 if info is None else info.step), loader.epoch, {}
    if checkpointing:
        record = {"rank": rank, "resumed_from": None if info is None else info.step, "t": time.time(),
                  "slice": os.environ.get("TPU_NAME"), "env": {k: os.environ.get(k) for k in ENV_KEYS}}
        if rank == 0:
            record["placement_groups"] = _live_placement_groups()
        with open(out / "attempts.jsonl", "a") as f:  # one short line per rank: an atomic append
            f.write(json.dumps(record) + "\n")
    device = ray_train_tpu.get_device()
    while step < STEPS:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            losses[step] = loss.item()
            if checkpointing:
                failing = step == FAIL_AFTER and fail and not (out / "failed").exists()
                if failing and fail == "save" and rank == 1:
                    _die_in_next_dcp_write(out / "failed")
                checkpoint.report({"loss": loss.item()}, model=model, optimizer=opt, lr_scheduler=sched,
                                  dataloader=loader, step=step, extra={"epoch": epoch})
                if failing and fail == "host" and rank == 0:
                    _wait_for_host_loss(out)
            if step == STEPS:
                break
        epoch += 1
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, opt, options=full)}, losses


def _live_placement_groups() -> list:
    """The IPs of the nodes holding each placement group not removed, now."""
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    table = ray.util.placement_group_table().values()
    return [sorted({ips.get(node) for node in pg["bundles_to_node_id"].values()})
            for pg in table if pg["state"] != "REMOVED"]


def _fail_now(marker: Path) -> None:
    marker.write_text(str(time.time()))
    os._exit(1)


def _die_in_next_dcp_write(marker: Path) -> None:
    """The next DCP save on this rank exits the process as it starts writing files."""
    from torch.distributed.checkpoint import FileSystemWriter

    FileSystemWriter.write_data = lambda *args, **kwargs: _fail_now(marker)


def _wait_for_host_loss(out: Path) -> None:
    """Ask the driver to remove a host of this slice, then wait to be stopped."""
    (out / "remove_host").write_text(os.environ["TPU_NAME"])
    deadline = time.time() + 300
    while time.time() < deadline:
        time.sleep(1)
    raise RuntimeError("the driver did not remove a host of this slice within 300 s")


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


def _remove_host_when_asked(sim, out: Path, stop: threading.Event) -> None:
    """Driver side of the "host" failure: remove TPU worker 1 of the slice rank 0 names."""
    request = out / "remove_host"
    while not stop.is_set():
        if request.exists() and (name := request.read_text()):
            slice_id = sim.slice_names.index(name)
            (out / "failed").write_text(str(time.time()))
            sim.remove_host(slice_id, 1)
            return
        time.sleep(0.2)


def _fit(tmp_path, name, strategy, fail=None, sim=None):
    out = tmp_path / name
    out.mkdir()
    stop = threading.Event()
    if fail == "host":
        threading.Thread(target=_remove_host_when_asked, args=(sim, out, stop), daemon=True).start()
    trainer = TorchTrainer(
        _train,
        train_loop_config={"out": str(out), "strategy": strategy, "fail": fail},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        torch_config=TPUTorchConfig(),
        run_config=ray.train.RunConfig(
            storage_path=str(tmp_path / "storage"), name=name, failure_config=ray.train.FailureConfig(max_failures=1)
        ),
    )
    start = time.time()
    try:
        result = trainer.fit()
    finally:
        stop.set()
    assert result.error is None, result.error
    records = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    attempts = _group_attempts(records)
    return dict(result=result, attempts=attempts, seconds=time.time() - start, out=out, **torch.load(out / "final.pt"))


def _group_attempts(records: list) -> list:
    """Per attempt (in order), its records by rank; every rank writes one per attempt."""
    records.sort(key=lambda r: r["t"])
    attempts, seen = [], set()
    for r in records:
        if not attempts or r["rank"] in seen:
            attempts.append({})
            seen = set()
        attempts[-1][r["rank"]] = r
        seen.add(r["rank"])
    return attempts


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


def test_resume_after_a_worker_dies_writing_a_checkpoint_is_bitwise_exact(sim, tmp_path):
    """FSDP2: a worker dies writing a checkpoint; the export of the last one is exact too."""
    run = _fit(tmp_path, "fsdp2", "fsdp2", fail="save")
    print(f"fsdp2, save failure: {run['seconds']:.0f} s")
    _assert_exact_resume(run)
    assert run["attempts"][1][0]["resumed_from"] < FAIL_AFTER  # the step being written never became a checkpoint
    _assert_exports_bitwise(run, tmp_path)


def _assert_exports_bitwise(run, tmp_path):
    """Ray's last checkpoint (FSDP2, 8 ranks on 2 simulated hosts), exported in this process as a
    Hugging Face directory, holds the final full state dict bit for bit (issue 34)."""
    from safetensors.torch import load_file, save_file

    from ray_train_tpu.checkpoint import export_hf

    final = run["resumed"]["model"]
    base = tmp_path / "base"  # a "base model": the same names and shapes, other values
    base.mkdir()
    save_file({k: torch.zeros_like(v) for k, v in final.items()}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    info = export_hf(run["result"].checkpoint, base, tmp_path / "exported")
    assert (info.step, info.world_size) == (STEPS, WORLD)
    exported = load_file(str(tmp_path / "exported" / info.files[0]))
    _assert_bitwise_equal(exported, final, "export")


def test_lost_host_restarts_the_run_on_a_whole_free_slice(sim, tmp_path):
    """A host of the slice in use disappears: the attempt fails, and the retry
    takes the other, whole slice (never what is left of the first) with launch
    variables planned afresh for it, resuming exactly. No placement group is left."""
    run = _fit(tmp_path, "host", "ddp", fail="host", sim=sim)
    print(f"host loss: {run['seconds']:.0f} s")
    _assert_exact_resume(run)
    first, second = run["attempts"]
    assert len({r["slice"] for r in first.values()}) == 1 and len({r["slice"] for r in second.values()}) == 1
    lost, taken = first[0]["slice"], second[0]["slice"]
    assert taken != lost, "the retry ran on what was left of the slice that lost a host"
    slice_id = sim.slice_names.index(taken)
    env0 = second[0]["env"]
    plan = build_plan(
        Topology.parse(TOPOLOGY, ACCEL),
        hosts=[sim.hosts[(slice_id, 0)], sim.hosts[(slice_id, 1)]],
        xprof_session_id=env0["TORCH_TPU_XPROF_SESSION_ID"],
        master_port=int(env0["MASTER_PORT"]),
    )
    for rank, record in second.items():
        assert record["env"] == {k: worker_env(plan, rank).get(k) for k in ENV_KEYS}, rank
    assert env0["TORCH_TPU_XPROF_SESSION_ID"] != first[0]["env"]["TORCH_TPU_XPROF_SESSION_ID"]
    assert env0["MASTER_ADDR"] != first[0]["env"]["MASTER_ADDR"]
    # The failed attempt's placement groups (slice head and slice) were released:
    # while the retry runs, those alive are as many as before and on its slice.
    new_hosts = {sim.hosts[(slice_id, 0)], sim.hosts[(slice_id, 1)]}
    assert len(second[0]["placement_groups"]) == len(first[0]["placement_groups"]) >= 1
    assert all(set(ips) <= new_hosts for ips in second[0]["placement_groups"]), second[0]["placement_groups"]
    live = {k: v for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    assert not live, f"placement groups left after fit(): {live}"


def _assert_exact_resume(run, resumed_range=(1, FAIL_AFTER)):
    first, second = (run["attempts"] + [{}, {}])[:2]
    assert len(run["attempts"]) == 2 and sorted(first) == sorted(second) == list(range(WORLD)), run["attempts"]
    resumed_from = second[0]["resumed_from"]
    assert {r["resumed_from"] for r in first.values()} == {None}
    assert {r["resumed_from"] for r in second.values()} == {resumed_from}
    # Ray registers a step's checkpoint once it has collected every rank's report
    # of it; reports not yet collected when a worker dies are lost, so the run
    # may resume a step or two before FAIL_AFTER (seen: 3 with FAIL_AFTER 5).
    assert resumed_range[0] <= resumed_from <= resumed_range[1], resumed_from
    # Survivors blocked in a collective were stopped by Ray, not by its timeout.
    restart_s = min(r["t"] for r in second.values()) - float((run["out"] / "failed").read_text())
    print(f"failure to restarted worker group: {restart_s:.0f} s")
    assert 0 < restart_s < PG_TIMEOUT_S / 6
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
