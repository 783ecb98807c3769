"""Hang detection inside a step: the pure detector, the non-blocking watch, and the
counters it reads (c10d's sequence numbers) on a real gloo group."""

import pickle

import pytest
import ray.train

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


def _counts(rank, world_size):
    """c10d's counters through the seam, read while rank 1 is still outside a collective."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from ray_train_tpu._compat import torch as compat_torch

    seen = {"start": compat_torch.collective_sequence_numbers()}
    dist.all_reduce(torch.ones(1))
    seen["after_one"] = compat_torch.collective_sequence_numbers()
    if rank == 1:
        time.sleep(1.5)  # rank 0 waits in the next all-reduce meanwhile
    else:
        reader = threading.Thread(target=lambda: (time.sleep(0.7), seen.setdefault(
            "while_waiting", compat_torch.collective_sequence_numbers())))
        reader.start()
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        reader.join()
    return seen


def test_c10d_counts_collectives_as_issued_and_can_be_read_while_one_blocks():
    first, second = _spawn.run(_counts, 2)
    world = next(iter(first["start"]))
    assert first["start"] == {world: ((0, 1), 0)} and first["after_one"] == {world: ((0, 1), 1)}
    assert first["while_waiting"] == {world: ((0, 1), 2)}  # issued, and waiting for rank 1 (still at 1)
    assert second["after_one"] == {world: ((0, 1), 1)}
