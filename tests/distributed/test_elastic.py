"""Elastic, preemptible multi-slice training: one run through every fault, on
3 simulated one-host slices (TPU-V6E 1x1: one chip, one worker each).

The run (`TPUTorchTrainer`, ``num_slices=(2, 3)``, DDP, a kept global batch of 6,
a periodic checkpoint every EVERY steps, a `PreemptionGuard`, ``hang_timeout_s``)
is driven by the test on its steps, through five attempts:

- A1 on 3 slices: every raylet of slice 2 is killed -> a worker failure;
- A2 on slices 0-1: slice 2 comes back -> Ray's elastic policy resizes;
- A3 on 3 slices: SIGTERM to slice 1's worker *while it writes a periodic
  checkpoint*, and Ray drains its node (what ``ray start`` does on the same
  SIGTERM); every rank checkpoints at the next step, then the slice is killed
  before the deadline -> a preemption;
- A4 on slices 0 and 2: slice 2's worker freezes (SIGSTOP) mid-run -> the hang
  watch fails the attempt, naming its rank and host, and where each rank waits
  (py-spy reads the frozen one's frame from its host);
- A5 on slices 0 and 2: slice 2's rank returns from the training function (it
  left the loop early; not a frozen process: it answers) while rank 0 waits in
  the next collective -> the hang watch, counting collective entries itself
  (the simulated tpu_dist has no c10d sequence numbers), fails the attempt;
- A6 on slices 0 and 2, from the last checkpoint, to the end.

``FailureConfig(max_failures=3, max_preemption_failures=1)``: the run fails if the
preemption were charged to ``max_failures``. The losses of the surviving steps
must equal those of a one-process reference that trains on the same global
batches and switches between 3 and 2 shards at the same checkpoints (the data
order follows from ``DistributedSampler``'s epoch order; no checkpoint, no Ray).
"""

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.train
import torch

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig, TPUTorchTrainer
from ray_train_tpu.cli.plan import build_plan, worker_env
from ray_train_tpu._compat import ray_train as compat_ray
from ray_train_tpu.launch_env import ENV_KEYS, MEGASCALE_KEYS
from ray_train_tpu.testing.simulated_cluster import host_ip
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL = "1x1", "TPU-V6E"
# The GCS notices a killed host in ~3 s (default ~15 s): Ray's elastic policy counts a
# slice intact until then (docs/elastic.md, "What was measured").
SIMULATED_SLICE = dict(topology=TOPOLOGY, accelerator_type=ACCEL, num_slices=3, system_config={
    "health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3})
N, GLOBAL_BATCH, SEED, EVERY = 96, 6, 7, 4
STEP_S = 0.25  # a step's floor, so that the driver acts mid-run
GRACE_S = 10.0  # the notice's deadline (the guard's grace period)
HANG_TIMEOUT_S = 8.0
PLAN = ("kill", "grow", "notice", "stall", "leave", "finish")


def _net():
    from torch import nn

    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(N, 6, generator=g), torch.randn(N, 2, generator=g))


def _parts(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)


# Worker side ------------------------------------------------------------------------


def _train(config):
    import torch.distributed as dist
    from torch import nn

    import ray_train_tpu
    from ray_train_tpu import checkpoint
    from ray_train_tpu.data import stateful_dataloader

    out, ctx = Path(config["out"]), ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray_train_tpu.get_device()
    torch.manual_seed(0)
    model = ray_train_tpu.prepare_model(_net())
    opt, sched = _parts(model)
    loader = stateful_dataloader(_data(), global_batch_size=GLOBAL_BATCH, seed=SEED)
    info = checkpoint.restore(model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
    # One id for every rank of this attempt: the backend plans a new xprof session per attempt.
    step, attempt = (0 if info is None else info.step), f"{os.environ['TORCH_TPU_XPROF_SESSION_ID']}-{world}"
    _append(out / "attempts.jsonl", {
        "attempt": attempt, "rank": rank, "world": world, "resumed_from": None if info is None else info.step,
        "t": time.time(), "slice": os.environ.get("TPU_NAME"),
        "env": {k: os.environ.get(k) for k in ENV_KEYS + MEGASCALE_KEYS}})
    with checkpoint.PreemptionGuard(grace_period_s=GRACE_S) as guard:
        epoch = loader.epoch
        while True:
            loader.set_epoch(epoch)
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                step += 1
                if rank == 0:
                    _append(out / "losses.jsonl", {"attempt": attempt, "step": step, "loss": loss.item(), "t": time.time()})
                time.sleep(STEP_S)
                _notice_in_next_save(out, step, world)
                if _leaves_now(out, step):
                    return  # left the loop early: rank 0 waits in the next collective (the guard's)
                preempted = guard.requested()
                flag = torch.tensor([int(rank == 0 and (out / "stop").exists())], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if preempted or step % EVERY == 0 or flag.item():
                    checkpoint.report({"step": step, "preempted": preempted}, model=model, optimizer=opt,
                                      lr_scheduler=sched, dataloader=loader, step=step)
                if preempted:
                    guard.stop()  # parks until Ray restarts the run at the deadline
                if flag.item():
                    return
            epoch += 1


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:  # one short line: an atomic append
        f.write(json.dumps(record) + "\n")


def _leaves_now(out: Path, step: int) -> bool:
    """When the driver asks (file "leave"), the worker of slice 2 leaves the loop, once."""
    if os.environ.get("TPU_NAME") != "sim-slice-2" or not (out / "leave").exists() or (out / "left").exists():
        return False
    (out / "left").write_text(json.dumps({"t": time.time(), "step": step}))
    return True


def _notice_in_next_save(out: Path, step: int, world: int) -> None:
    """When the driver asks (file "notice"), the worker of slice 1 sends itself SIGTERM
    inside its write of the next periodic checkpoint: a notice in the middle of a save."""
    import signal

    if os.environ.get("TPU_NAME") != "sim-slice-1" or not (out / "notice").exists() or (out / "noticed").exists():
        return
    if step % EVERY != 0:
        return
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def notice_then_write(self, *args, **kwargs):
        FileSystemWriter.write_data = write_data
        (out / "noticed").write_text(json.dumps({"t": time.time(), "step": step}))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the notice lands while this rank's files are being written
        return write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = notice_then_write


# Driver side ------------------------------------------------------------------------


class _Driver:
    """Injects each fault once the run has reached the right attempt and step; runs on
    the main thread (a raylet can only be started there), while fit() runs in another."""

    def __init__(self, sim, out: Path, fit: threading.Thread):
        self.sim, self.out, self.fit, self.events = sim, out, fit, {}

    def _latest(self):
        """(attempt id, world size, last step) of the newest attempt that trained a step."""
        path = self.out / "losses.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        if not lines:
            return None, 0, 0
        last = json.loads(lines[-1])
        return last["attempt"], int(last["attempt"].split("-")[1]), last["step"]

    def _wait(self, predicate, what: str, timeout_s=240.0):
        deadline = time.monotonic() + timeout_s
        while not predicate(*self._latest()):
            if not self.fit.is_alive():
                raise RuntimeError(f"fit() ended while waiting for {what}; events {self.events}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not reach {what} in {timeout_s:g} s; events {self.events}")
            time.sleep(0.1)

    def run(self):
        seen = set()

        def new_attempt(world, steps):
            return lambda attempt, w, step: attempt not in seen and w == world and step >= steps

        self._wait(new_attempt(3, 10), "A1 on 3 slices")  # Ray has taken step 4's report by then
        seen.add(self._latest()[0])
        self.events["kill"] = time.time()
        self.sim.remove_slice(2)
        self._wait(new_attempt(2, 1), "A2 on 2 slices")
        seen.add(self._latest()[0])
        self.events["grow"] = time.time()
        self.sim.add_slice(2)
        self._wait(new_attempt(3, 1), "A3 on 3 slices again")
        seen.add(self._latest()[0])
        (self.out / "notice").write_text("1")
        deadline = time.monotonic() + 120
        while not (self.out / "noticed").exists():
            if not self.fit.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"no notice was sent; events {self.events}")
            time.sleep(0.05)
        noticed = json.loads((self.out / "noticed").read_text())
        self.events["notice"] = noticed["t"]
        # What `ray start` does on the same SIGTERM (a spot VM's shutdown signals every
        # process): drain the node for a preemption, with the notice's deadline.
        self.sim.drain_host(1, 0, deadline_s=noticed["t"] + GRACE_S - time.time())
        time.sleep(max(0.0, noticed["t"] + GRACE_S - 2.0 - time.time()))  # reclaimed within its notice
        self.events["reclaim"] = time.time()
        self.sim.remove_slice(1)
        self._wait(new_attempt(2, 2), "A4 on the slices left")
        seen.add(self._latest()[0])
        self.events["stall"] = time.time()
        self.events["stalled_pids"] = self.sim.stall_host(2, 0)
        assert self.events["stalled_pids"], "no worker process found on host (2, 0)"
        self._wait(new_attempt(2, 3), "A5 after the hang")
        seen.add(self._latest()[0])
        self.events["leave"] = time.time()
        (self.out / "leave").write_text("1")
        self._wait(new_attempt(2, 3), "A6 after the rank that left")
        self.events["finish"] = time.time()
        (self.out / "stop").write_text("done")


@pytest.fixture(scope="module")
def run(sim, tmp_path_factory):
    """The one elastic run, and what it left behind."""
    with pytest.MonkeyPatch.context() as env:
        # Ray Train reads these on the driver and passes them to its controller: the
        # PreemptionWatcher polls every 1 s (5 s), and a worker group whose placement
        # group cannot be placed (a slice the GCS does not know is dead yet) gives up
        # after 20 s (60 s).
        env.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
        env.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
        return _run(sim, tmp_path_factory.mktemp("elastic"))


def _run(sim, out: Path) -> dict:
    trainer = TPUTorchTrainer(
        _train,
        train_loop_config={"out": str(out)},
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL, num_slices=(2, 3),
                                        elastic_resize_monitor_interval_s=2),
        torch_config=TPUTorchConfig(hang_timeout_s=HANG_TIMEOUT_S),
        run_config=ray.train.RunConfig(
            storage_path=str(out / "storage"), name="elastic",
            failure_config=ray.train.FailureConfig(max_failures=3, max_preemption_failures=1),
            callbacks=[compat_ray.controller_state_log(str(out / "controller.jsonl"))]),
    )
    outcome = {}
    fit = threading.Thread(target=lambda: outcome.update(result=trainer.fit()), daemon=True)
    start = time.time()
    fit.start()
    driver = _Driver(sim, out, fit)
    try:
        driver.run()
    finally:
        (out / "stop").write_text("stop")
        fit.join(300)
        states = [json.loads(line) for line in (out / "controller.jsonl").read_text().splitlines()]
        for state in states:
            if state["from"] != state["to"]:
                print(f"{state['t'] - start:6.1f} s  {state['from']} -> {state['to']}  {state['error_type'] or ''}")
    print(f"elastic run: {time.time() - start:.0f} s, events {driver.events}")
    result = outcome["result"]
    assert result.error is None, result.error
    records = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    attempts = {}
    for r in records:
        attempts.setdefault(r["attempt"], {})[r["rank"]] = r
    losses = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return dict(result=result, out=out, events=driver.events, losses=losses, states=states,
                attempts=[attempts[k] for k in sorted(attempts, key=lambda a: float(a.split("-")[0]))])


def test_each_attempt_runs_on_the_live_slices_with_an_environment_planned_for_them(run, sim):
    attempts = run["attempts"]
    slices = [sorted({r["slice"] for r in a.values()}) for a in attempts]
    assert slices == [["sim-slice-0", "sim-slice-1", "sim-slice-2"], ["sim-slice-0", "sim-slice-1"],
                      ["sim-slice-0", "sim-slice-1", "sim-slice-2"], ["sim-slice-0", "sim-slice-2"],
                      ["sim-slice-0", "sim-slice-2"], ["sim-slice-0", "sim-slice-2"]], slices
    topology = Topology.parse(TOPOLOGY, ACCEL)
    for attempt in attempts:
        env0 = attempt[0]["env"]
        hosts = [host_ip(int(attempt[r]["slice"].rsplit("-", 1)[1]), 0) for r in sorted(attempt)]
        plan = build_plan(topology, hosts=hosts, num_slices=len(attempt),
                          xprof_session_id=env0["TORCH_TPU_XPROF_SESSION_ID"], master_port=int(env0["MASTER_PORT"]))
        for rank, record in attempt.items():
            want = worker_env(plan, rank)
            assert record["env"] == {k: want.get(k) for k in ENV_KEYS + MEGASCALE_KEYS}, (rank, record["slice"])
        assert env0["MEGASCALE_NUM_SLICES"] == str(len(attempt))
    live = {k: v for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    assert not live, f"placement groups left after fit(): {live}"


def test_the_losses_equal_a_reference_that_switches_world_size_at_the_same_checkpoints(run):
    attempts = run["attempts"]
    resumed = [a[0]["resumed_from"] or 0 for a in attempts]
    worlds = [len(a) for a in attempts]
    final = {}
    for record in run["losses"]:  # a later attempt redoes the steps after its checkpoint
        final[record["step"]] = record["loss"]
    assert sorted(final) == list(range(1, max(final) + 1))
    expected = _reference(resumed, worlds, max(final))
    got = torch.tensor([final[s] for s in sorted(final)])
    assert torch.allclose(got, torch.tensor(expected), rtol=1e-4, atol=1e-6), (got, expected)
    assert resumed == sorted(resumed), resumed


def _reference(resumed: list, worlds: list, steps: int) -> list:
    """Rank 0's loss at each step of a one-process run on the same global batches: at
    step s the world is that of the last attempt that resumed before s, and each rank r
    of W reads the epoch's order from the job's position on, its shard rest[r::W]."""
    from torch import nn

    torch.manual_seed(0)
    model = _net()
    opt, sched = _parts(model)
    x, y = _data().tensors
    epoch, consumed, losses = 0, 0, []
    for step in range(1, steps + 1):
        world = worlds[max(i for i, r in enumerate(resumed) if r < step)]
        per_rank = GLOBAL_BATCH // world
        rest = _order(epoch)[consumed:]
        if (len(rest) - len(rest) % world) // world < per_rank:  # the epoch is used up
            epoch, consumed = epoch + 1, 0
            rest = _order(epoch)
        shards = [rest[r::world][:per_rank] for r in range(world)]
        batch = torch.tensor([i for shard in shards for i in shard])
        out = model(x[batch])
        losses.append(nn.functional.mse_loss(out[:per_rank], y[batch][:per_rank]).item())  # rank 0's batch
        nn.functional.mse_loss(out, y[batch]).backward()  # DDP: the mean of equal per-rank means
        opt.step()
        opt.zero_grad()
        sched.step()
        consumed += GLOBAL_BATCH
    return losses


def _order(epoch: int) -> list:
    whole = torch.utils.data.DistributedSampler(list(range(N)), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    whole.set_epoch(epoch)
    return list(whole)


def test_a_notice_during_a_save_checkpoints_every_rank_just_in_time_and_counts_as_a_preemption(run):
    from ray_train_tpu import checkpoint

    attempts, noticed = run["attempts"], json.loads((run["out"] / "noticed").read_text())
    a3, a4 = attempts[2], attempts[3]
    jit = a4[0]["resumed_from"]
    # the periodic checkpoint being written at the notice completed; the guard's check reads one
    # step late (no host sync per step), so the step after next was saved at once
    assert jit == noticed["step"] + 2 and jit % EVERY != 0, (jit, noticed)
    steps = []  # of the complete, intact checkpoints (a slice killed mid-upload may leave a partial one)
    for path in (run["out"] / "storage" / "elastic").iterdir():
        if path.is_dir() and path.name.startswith("checkpoint_"):
            try:
                steps.append(checkpoint.verify(path)["step"])
            except checkpoint.CheckpointError:
                pass
    assert noticed["step"] in steps and jit in steps, sorted(steps)
    # Ray charged it to max_preemption_failures: its own PreemptionError, after its
    # PreemptingState (with max_failures=3 for the kill and the two hangs, a fourth worker
    # failure would have failed the run).
    restarts = [s for s in run["states"] if s["to"] == "RestartingState"]
    assert [s["error_type"] for s in restarts] == ["WorkerGroupError", "PreemptionError", "CollectiveHangError",
                                                   "CollectiveHangError"], restarts
    assert any(s["to"] == "PreemptingState" for s in run["states"])
    assert any(s["to"] == "ResizingState" for s in run["states"])  # the slice's return
    restart_s = min(r["t"] for r in a4.values()) - run["events"]["notice"]
    print(f"notice to the attempt on the remaining slices: {restart_s:.0f} s")


def test_a_host_stalled_mid_step_fails_the_attempt_naming_it_and_the_run_resumes(run):
    a4, a5 = run["attempts"][3], run["attempts"][4]
    stalled = run["events"]["stall"]
    waited = min(r["t"] for r in a5.values()) - stalled
    print(f"stall to the next attempt: {waited:.0f} s (hang_timeout_s={HANG_TIMEOUT_S:g})")
    assert HANG_TIMEOUT_S <= waited < HANG_TIMEOUT_S + 90
    a4_steps = [r["step"] for r in run["losses"] if r["attempt"] == a4[0]["attempt"]]
    periodic = [s for s in a4_steps if s % EVERY == 0]
    assert a5[0]["resumed_from"] == (max(periodic) if periodic else a4[0]["resumed_from"])
    hang = next(s for s in run["states"] if s["error_type"] == "CollectiveHangError")
    assert re.search(r"collective hang: rank\(s\) 1 on host\(s\) 127\.0\.3\.1 \(sim-slice-2\) did not join",
                     hang["error"]), hang["error"]
    assert "did not even answer" in hang["error"]  # a frozen process
    # where each waits: rank 0 in a collective (its own answer), rank 1 read by py-spy from its host
    assert re.search(r"rank 0 \(127\.0\.1\.1 \(sim-slice-0\)\): \S+ \([^)]*\) in _train \([^)]*test_elastic\.py:\d+\)",
                     hang["error"]), hang["error"]
    assert re.search(r"rank 1 \(127\.0\.3\.1 \(sim-slice-2\)\): [^;]*test_elastic\.py:\d+\)[^;]* \(py-spy\)",
                     hang["error"]), hang["error"]


def test_a_rank_that_left_the_loop_early_fails_the_attempt_naming_it_and_the_run_resumes(run):
    """Not a frozen process: rank 1 answers, its counters are behind (no c10d counters on tpu_dist)."""
    a5, a6 = run["attempts"][4], run["attempts"][5]
    left = json.loads((run["out"] / "left").read_text())
    waited = min(r["t"] for r in a6.values()) - left["t"]
    print(f"rank left to the next attempt: {waited:.0f} s (hang_timeout_s={HANG_TIMEOUT_S:g})")
    assert HANG_TIMEOUT_S <= waited < HANG_TIMEOUT_S + 90
    a5_steps = [r["step"] for r in run["losses"] if r["attempt"] == a5[0]["attempt"]]
    periodic = [s for s in a5_steps if s % EVERY == 0]
    assert a6[0]["resumed_from"] == (max(periodic) if periodic else a5[0]["resumed_from"])
    error = [s for s in run["states"] if s["error_type"] == "CollectiveHangError"][1]["error"]
    assert re.search(r"collective hang: rank\(s\) 1 on host\(s\) 127\.0\.3\.1 \(sim-slice-2\) did not join collective #\d+",
                     error), error
    assert "rank(s) 1 had returned from the training function (left the loop early)" in error
    assert "did not even answer" not in error
    assert re.search(r"rank 0 \(127\.0\.1\.1 \(sim-slice-0\)\): \S+ \([^)]*\) in _train \([^)]*test_elastic\.py:\d+\)",
                     error), error
