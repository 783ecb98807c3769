"""Hang detection inside a step: the pure detector, the non-blocking watch, and what
each rank answers (its own collective entries, steps and training-thread frame) on the
strict stand-in of torch_tpu's tpu_dist, which has no c10d sequence numbers."""

import pickle

import pytest
import ray.train

from ray_train_tpu import hang as hang_mod
from ray_train_tpu.hang import CollectiveHangError, CollectiveWatch, HangDetector, hang_message
from ray_train_tpu.testing import gloo as _spawn

HOSTS = ["10.0.0.1 (s0)", "10.0.0.1 (s0)", "10.0.0.2 (s1)", "10.0.0.2 (s1)"]


def _world(seqs, name="0"):
    ranks = tuple(range(len(seqs)))
    return [{name: (ranks, s)} for s in seqs]


def test_ranks_behind_in_a_group_with_no_progress_for_the_timeout_are_a_hang():
    d = HangDetector(timeout_s=30, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([7, 7, 6, 6])):
        d.observe(rank, counters, now=2)
    assert d.verdict(now=31) is None  # 29 s since the last progress
    hang = d.verdict(now=33)
    assert hang.missing_ranks == (2, 3) and hang.unresponsive_ranks == ()
    assert hang.waiting == {"0": (7, (0, 1))}
    message = hang_message(hang, d)
    assert "rank(s) 2-3 on host(s) 10.0.0.2 (s1) did not join collective #7 of process group '0'" in message
    assert "in which rank(s) 0-1 waited" in message and "hang_timeout_s=30" in message


def test_progress_on_any_rank_restarts_the_clock():
    d = HangDetector(timeout_s=10, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([3, 3, 2, 3])):
        d.observe(rank, counters, now=1)
    d.observe(2, _world([3, 3, 3, 3])[2], now=9)  # rank 2 caught up
    assert d.verdict(now=15) is None
    for rank, counters in enumerate(_world([4, 4, 4, 3])):
        d.observe(rank, counters, now=16)
    assert d.verdict(now=27).missing_ranks == (3,)


def test_equal_counters_without_progress_are_not_a_collective_hang():
    """Every rank busy alone (a long first-step compile, a save): nobody waits for anyone."""
    d = HangDetector(timeout_s=5, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([9, 9, 9, 9])):
        d.observe(rank, counters, now=0)
    assert d.verdict(now=1000) is None


def test_a_rank_that_never_answers_is_missing_and_named_unresponsive():
    d = HangDetector(timeout_s=10, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([5, 5, 5, 5])[:3]):
        d.observe(rank, counters, now=1)
    d.asked(3, now=1)
    hang = d.verdict(now=12)
    assert hang.missing_ranks == hang.unresponsive_ranks == (3,)
    assert "did not even answer" in hang_message(hang, d)
    d.forget(3)  # its worker died: Ray Train's own poll reports that
    assert d.verdict(now=30) is None


def test_subgroups_are_judged_by_their_own_members():
    """A TP group of ranks 2-3 where rank 3 never joins; the world group agrees."""
    d = HangDetector(timeout_s=5, hosts=HOSTS, now=0)
    for rank in range(4):
        counters = {"0": ((0, 1, 2, 3), 10)}
        if rank >= 2:
            counters["tp"] = ((2, 3), 4 if rank == 2 else 3)
        d.observe(rank, counters, now=0)
    hang = d.verdict(now=6)
    assert hang.missing_ranks == (3,) and hang.waiting == {"tp": (4, (2,))}


def test_the_error_is_a_ray_worker_group_error_that_survives_pickling():
    """Ray Train retries a WorkerGroupError against max_failures (as NCCLHangError)."""
    error = CollectiveHangError("boom", {}, (2, 3), ("h1",))
    assert isinstance(error, ray.train.WorkerGroupError)
    again = pickle.loads(pickle.dumps(error))
    assert (again.missing_ranks, again.missing_hosts, str(again)) == ((2, 3), ("h1",), str(error))


class _Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error, self.ready = value, error, True


def _get(ref):
    if ref.error:
        raise ref.error
    return ref.value


def test_the_watch_never_blocks_and_raises_naming_ranks_and_hosts(monkeypatch):
    """Ranks 0-2 answer; rank 3 (frozen) never does: after the timeout the poll raises."""
    import ray

    clock = [0.0]
    answers = {0: 5, 1: 5, 2: 4}
    asked = []

    def ask(rank):
        asked.append(rank)
        if rank == 3:
            ref = _Ref()
            ref.ready = False
            return ref
        return _Ref({"0": ((0, 1, 2, 3), answers[rank])})

    def wait(refs, num_returns, timeout):
        assert timeout == 0  # never blocks the controller's loop
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    monkeypatch.setattr(ray, "get", _get)
    watch = CollectiveWatch(ask, 4, HangDetector(10, HOSTS, now=0), wait=wait, clock=lambda: clock[0])
    for t in range(0, 10):
        clock[0] = float(t)
        watch.poll()
    assert asked.count(3) == 1  # an unanswered question is not asked again
    clock[0] = 12.0
    with pytest.raises(CollectiveHangError) as caught:
        watch.poll()
    assert caught.value.missing_ranks == (2, 3)
    assert caught.value.missing_hosts == ("10.0.0.2 (s1)",)
    assert "rank(s) 3 did not even answer" in str(caught.value)


def test_a_dead_worker_is_left_to_ray_train(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", _get)
    refs = {0: _Ref({"0": ((0, 1), 3)}), 1: _Ref(error=ray.exceptions.RayActorError())}
    clock = [0.0]
    watch = CollectiveWatch(lambda r: refs[r], 2, HangDetector(5, HOSTS[:2], now=0),
                            wait=lambda refs, num_returns, timeout: (refs, []), clock=lambda: clock[0])
    for t in (0.0, 1.0, 100.0):
        clock[0] = t
        watch.poll()  # no hang: rank 1 is gone, not missing


def test_a_loop_that_stepped_and_stops_stepping_is_a_hang_but_a_first_compile_is_not():
    """Equal counters, no progress: before any step (a fresh run's compile) that is every rank
    busy; after a step, or in an attempt that resumed, it is a loop that spins without steps."""
    fresh = HangDetector(timeout_s=5, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([3, 3, 3, 3])):
        fresh.observe(rank, counters, now=0)
    assert fresh.verdict(now=1000) is None
    stepped = HangDetector(timeout_s=5, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([3, 3, 3, 3])):
        stepped.observe(rank, counters, now=0, steps=1)
    for rank, counters in enumerate(_world([3, 3, 3, 3])):
        stepped.asked(rank, now=4)  # the watch asks every round, before it judges
        stepped.observe(rank, counters, now=4, steps=1)  # the same answers: no progress
        stepped.asked(rank, now=5)
    assert stepped.verdict(now=4.9) is None
    hang = stepped.verdict(now=5.1)
    assert hang.no_step and hang.missing_ranks == (0, 1, 2, 3)
    assert "no rank took a step or entered a collective for 5 s" in hang_message(hang, stepped)
    resumed = HangDetector(timeout_s=5, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([0, 0, 0, 0])):
        resumed.observe(rank, counters, now=0, resumed=True)
    assert resumed.verdict(now=6).no_step
    busy = HangDetector(timeout_s=5, hosts=HOSTS, now=0)  # steps keep coming: no hang, however long
    for t in range(0, 60, 4):
        for rank, counters in enumerate(_world([3, 3, 3, 3])):
            busy.observe(rank, counters, now=t, steps=t)
        assert busy.verdict(now=t + 3) is None


def test_a_rank_that_returned_from_the_training_function_is_named_so():
    d = HangDetector(timeout_s=5, hosts=HOSTS, now=0)
    for rank, counters in enumerate(_world([8, 8, 8, 7])):
        d.observe(rank, counters, now=0, steps=2, finished=rank == 3,
                  frame="all_reduce (torch/distributed/distributed_c10d.py:1) in train (t.py:9)" if rank < 3 else None)
    hang = d.verdict(now=6)
    assert hang.missing_ranks == hang.finished_ranks == (3,)
    message = hang_message(hang, d)
    assert "rank(s) 3 had returned from the training function (left the loop early)" in message
    assert "rank 0 (10.0.0.1 (s0)): all_reduce (torch/distributed/distributed_c10d.py:1) in train (t.py:9)" in message


def test_a_frozen_rank_is_named_with_the_frame_py_spy_reads_from_its_host(monkeypatch):
    """The dump starts at the half-way warning (so the verdict does not wait for it)."""
    import ray

    monkeypatch.setattr(ray, "get", _get)
    clock, dumps = [0.0], []

    def ask(rank):
        if rank == 1 and clock[0] > 0:
            ref = _Ref()
            ref.ready = False
            return ref
        return _Ref({"collectives": {"0": ((0, 1), 2)}, "steps": 1, "pid": 100 + rank, "node_id": f"n{rank}"})

    def dump(pid, node_id):
        dumps.append((pid, node_id, clock[0]))
        return _Ref("wait (gloo.py:3) in train (t.py:7)")

    watch = CollectiveWatch(ask, 2, HangDetector(10, HOSTS[:2], now=0), clock=lambda: clock[0], dump=dump,
                            wait=lambda refs, num_returns, timeout: ([r for r in refs if r.ready], []))
    for t in range(0, 11):
        clock[0] = float(t)
        watch.poll()
    assert dumps and dumps[0][:2] == (101, "n1") and dumps[0][2] <= 7  # by the warning, before the verdict
    clock[0] = 12.0
    with pytest.raises(CollectiveHangError) as caught:
        watch.poll()
    assert caught.value.missing_ranks == (1,)
    assert "rank 1 (10.0.0.1 (s0)): wait (gloo.py:3) in train (t.py:7) (py-spy)" in str(caught.value)


_FROZEN = """
import threading, time
def wait_here():
    while True:
        time.sleep(0.05)
threading.Thread(target=wait_here, name="TrainingThread(train_func)", daemon=True).start()
print("up", flush=True)
time.sleep(600)
"""


def test_py_spy_reads_the_training_thread_of_a_frozen_process(tmp_path):
    """A SIGSTOPped process (a frozen host) cannot answer; py-spy reads its frames from outside."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "frozen_worker.py"
    script.write_text(_FROZEN)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        os.kill(proc.pid, signal.SIGSTOP)
        frame = hang_mod.py_spy_frame(proc.pid)
        assert frame.startswith("sleep") or frame.startswith("wait_here"), frame
        assert f"wait_here ({script}:5)" in frame, frame
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _two_faults(rank, world_size):
    """On the simulated tpu_dist (no c10d sequence numbers): (b) rank 0 enters a collective in a
    branch rank 1 never takes; (a) rank 1's training function returns while rank 0 goes on to
    the next collective. Each time every rank answers as the watch asks it (from another thread,
    while the training thread waits), then rank 1 releases rank 0."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    import ray_train_tpu

    hang_mod.install_worker_probes()
    device = ray_train_tpu.get_device()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1).to(device))  # 3 broadcasts
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    release = threading.Event()

    def train(phase):
        model(torch.ones(1, 2, device=device)).sum().backward()  # DDP's C++ all-reduce
        opt.step()
        if rank == 0:
            dist.all_reduce(torch.ones(1, device=device))  # (b) only rank 0 takes this branch, or (a) rank 1 left
        elif phase == "branch":
            release.wait()  # rank 1 goes on with other work

    answers = {}
    for phase in ("branch", "left"):
        thread = threading.Thread(target=train, args=(phase,), name=f"TrainingThread({phase})")
        thread.start()
        time.sleep(1.0 if rank == 0 else 2.0)  # rank 0 waits in its all-reduce by now; rank 1 answers after it
        answers[phase] = hang_mod.worker_progress()
        if rank == 1:
            release.set()
            thread.join()
            dist.all_reduce(torch.ones(1, device=device))  # releases rank 0
        thread.join()
    return answers


def test_entries_counted_on_the_simulated_tpu_dist_name_the_ranks_and_frames_of_both_faults():
    answers = _spawn.run(_two_faults, 2, simulate_tpu=True)
    for phase in ("branch", "left"):
        detector = HangDetector(timeout_s=10, hosts=["h0 (s0)", "h1 (s1)"], now=0)
        for rank, a in enumerate(answers):
            detector.observe(rank, a[phase]["collectives"], now=0, steps=a[phase]["steps"],
                             finished=a[phase]["finished"], frame=a[phase]["frame"])
        (name, (ranks, entered)), = answers[0][phase]["collectives"].items()
        assert ranks == (0, 1) and answers[1][phase]["collectives"][name][1] == entered - 1
        if phase == "branch":  # DDP's 3 broadcasts of its start and its all-reduce, and the all-reduce rank 0 waits in
            assert entered == 5
        else:  # and the second step's (DDP's bucket rebuild adds broadcasts), and the released all-reduce
            assert entered >= 5 + 3
        assert answers[0][phase]["steps"] == answers[1][phase]["steps"] == (1 if phase == "branch" else 2)
        hang = detector.verdict(now=11)
        assert hang.missing_ranks == (1,) and hang.waiting == {name: (entered, (0,))}
        message = hang_message(hang, detector)
        assert "rank(s) 1 on host(s) h1 (s1) did not join collective" in message
        assert "rank 0 (h0 (s0)): " in message and "in train (" in message and "test_hang.py" in message
        if phase == "branch":  # rank 1 is elsewhere in its loop
            assert answers[1][phase]["finished"] is False and "had returned" not in message
            assert "rank 1 (h1 (s1)): wait (" in message and "in train (" in message
        else:  # rank 1's training function returned
            assert answers[1][phase]["finished"] is True and "no training thread" in answers[1][phase]["frame"]
            assert "rank(s) 1 had returned from the training function (left the loop early)" in message


def test_the_watch_reports_a_loop_that_takes_no_step(monkeypatch):
    """Every rank answers each round with the same counters after having stepped (a loop over a
    loader with nothing left): the watch fails the attempt after the timeout, naming every rank."""
    import ray

    monkeypatch.setattr(ray, "get", _get)
    clock = [0.0]
    answer = {"collectives": {"0": ((0, 1), 9)}, "steps": 4, "frame": "__next__ (data.py:1) in train (t.py:3)"}
    watch = CollectiveWatch(lambda rank: _Ref(answer), 2, HangDetector(6, HOSTS[:2], now=0),
                            wait=lambda refs, num_returns, timeout: (refs, []), clock=lambda: clock[0])
    for t in range(0, 7):
        clock[0] = float(t)
        watch.poll()
    clock[0] = 8.0
    with pytest.raises(CollectiveHangError) as caught:
        watch.poll()
    assert caught.value.missing_ranks == (0, 1)
    assert "training hang: no rank took a step or entered a collective" in str(caught.value)
    assert "rank 1 (10.0.0.1 (s0)): __next__ (data.py:1) in train (t.py:3)" in str(caught.value)
