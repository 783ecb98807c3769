"""Hang detection inside a step: a collective that some ranks never join fails the attempt.

Ray Train 2.60's user-facing reference is its NCCL hang detector
(``train/v2/_internal/callbacks/nccl_ras.py``): the controller polls every
rank's collective counters, and a communicator whose ranks disagree and that
made no progress for a while is a hang; it raises ``NCCLHangError`` (a
``WorkerGroupError``), which Ray Train's failure policy retries against
``FailureConfig(max_failures)``, from the last checkpoint. NCCL RAS exists
only on GPUs; here the counters are c10d's own per-group sequence numbers
(`ray_train_tpu._compat.torch.collective_sequence_numbers`), which every rank
advances when it *issues* a collective (DDP's C++ all-reduces included).

`TPUTorchConfig(hang_timeout_s=...)` turns it on (default 600 s; None turns it
off). After the process group is up, the backend hooks a watch into Ray Train's
worker-group poll (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s): it asks
every rank for its counters (a light actor call, answered while the training
thread waits in a collective), and when no rank advanced any counter for
``hang_timeout_s`` while some ranks are behind the others in a group, or have
not answered at all (a frozen host), it raises `CollectiveHangError` naming
those ranks and their hosts. Half-way there it logs a warning.

What counts as a hang is a *disagreement* with no progress: every rank busy in
a long computation (a first-step compile) with equal counters is not one; a
rank that is still computing while the others wait for it longer than
``hang_timeout_s`` is, so the timeout must exceed the longest step, compile or
checkpoint one rank does alone.

Example:
    >>> d = HangDetector(timeout_s=10, hosts=["h0", "h0", "h1"], now=0.0)
    >>> for rank, seq in enumerate([5, 5, 4]):
    ...     d.observe(rank, {"0": ((0, 1, 2), seq)}, now=1.0)
    >>> d.verdict(now=5.0) is None          # not long enough without progress
    True
    >>> d.verdict(now=11.5).missing_ranks   # ranks 0-1 wait in collective 5; rank 2 never joined
    (2,)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Optional, Sequence

import ray.train

logger = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT_S = 600.0


class CollectiveHangError(ray.train.WorkerGroupError):
    """A collective that some ranks never joined, for ``hang_timeout_s``.

    A ``ray.train.WorkerGroupError`` (as Ray's ``NCCLHangError``): Ray Train
    retries it against ``FailureConfig(max_failures)`` from the last checkpoint.
    ``missing_ranks`` and ``missing_hosts`` name what did not join.
    """

    def __init__(self, error_message: str, worker_failures: Optional[dict] = None,
                 missing_ranks: tuple = (), missing_hosts: tuple = ()):
        super().__init__(error_message, worker_failures or {})
        self.missing_ranks = tuple(missing_ranks)
        self.missing_hosts = tuple(missing_hosts)

    def __reduce__(self):
        return (type(self), (self._error_message, self.worker_failures, self.missing_ranks, self.missing_hosts))


@dataclasses.dataclass(frozen=True)
class Hang:
    """What `HangDetector.verdict` found."""

    missing_ranks: tuple  # behind in a group, or not answering
    unresponsive_ranks: tuple  # did not answer at all (a frozen process or host)
    waiting: dict  # group name -> (collective number the leaders wait in, ranks that wait)
    stalled_s: float


class HangDetector:
    """Pure bookkeeping: per-rank counters in, a `Hang` out (no Ray, no clock).

    Args:
        timeout_s: how long no rank may advance any counter while they disagree.
        hosts: host of each rank (its description in messages), rank order.
        now: the time the watch starts (training start).
    """

    def __init__(self, timeout_s: float, hosts: Sequence[str], now: float):
        self.timeout_s = float(timeout_s)
        self.hosts = list(hosts)
        self._counters: dict = {}  # rank -> {group: (ranks, seq)}
        self._progress_at = now  # last time any rank's counters changed
        self._asked_at: dict = {}  # rank -> time of its unanswered question

    def asked(self, rank: int, now: float) -> None:
        self._asked_at.setdefault(rank, now)

    def forget(self, rank: int) -> None:
        """A rank whose worker died: Ray Train's own poll reports that failure."""
        self._asked_at.pop(rank, None)
        self._counters.pop(rank, None)

    def observe(self, rank: int, counters: dict, now: float) -> None:
        """Rank `rank` answered with `counters` ({group: (ranks, seq)})."""
        self._asked_at.pop(rank, None)
        if self._counters.get(rank) != counters:
            self._counters[rank] = counters
            self._progress_at = now

    def verdict(self, now: float) -> Optional[Hang]:
        stalled = now - self._progress_at
        if stalled < self.timeout_s:
            return None
        unresponsive = tuple(sorted(r for r, t in self._asked_at.items() if now - t >= self.timeout_s))
        behind, waiting = self._behind()
        missing = tuple(sorted(set(behind) | set(unresponsive)))
        if not missing:
            return None  # every rank idle at the same collective: not a collective hang
        return Hang(missing, unresponsive, waiting, stalled)

    def _behind(self) -> tuple[set, dict]:
        """Ranks behind the others in some group, and per such group the
        collective the leaders wait in and who they are."""
        seqs: dict = {}  # group -> {rank: seq}
        for rank, groups in self._counters.items():
            for name, (_, seq) in groups.items():
                seqs.setdefault(name, {})[rank] = seq
        behind, waiting = set(), {}
        for name, by_rank in seqs.items():
            top = max(by_rank.values())
            late = {r for r, s in by_rank.items() if s < top}
            if late:
                behind |= late
                waiting[name] = (top, tuple(sorted(set(by_rank) - late)))
        return behind, waiting

    def describe(self, ranks: Sequence[int]) -> tuple[str, tuple]:
        """("ranks 2-3 on host(s) h1", hosts) for messages."""
        hosts = tuple(sorted({self.hosts[r] for r in ranks if r < len(self.hosts)}))
        return f"rank(s) {ranges(ranks)} on host(s) {', '.join(hosts)}", hosts


def hang_message(hang: Hang, detector: HangDetector) -> str:
    who, _ = detector.describe(hang.missing_ranks)
    parts = [f"ray_train_tpu: collective hang: {who} did not join"]
    if hang.waiting:
        name, (seq, leaders) = next(iter(sorted(hang.waiting.items())))
        parts.append(f" collective #{seq} of process group {name!r}, in which rank(s) {ranges(leaders)} waited")
    else:
        parts.append(" the job's collectives")
    parts.append(f"; no rank made progress for {hang.stalled_s:.0f} s (hang_timeout_s={detector.timeout_s:g})")
    if hang.unresponsive_ranks:
        parts.append(f"; rank(s) {ranges(hang.unresponsive_ranks)} did not even answer (a frozen process or host)")
    parts.append(
        ". The attempt fails; Ray Train retries it from the last checkpoint against "
        "FailureConfig(max_failures). Look at those hosts (a stalled TPU, a rank that left the "
        "loop early, a collective in a branch only some ranks take), or raise "
        "TPUTorchConfig(hang_timeout_s=...) if one rank legitimately works alone that long."
    )
    return "".join(parts)


class CollectiveWatch:
    """Asks every rank for its counters without blocking and feeds a `HangDetector`.

    `ask(rank)` returns an ObjectRef of that rank's counters (the backend uses
    ``worker_group.execute_single_async``); `wait` is ``ray.wait``. `poll` is
    called from Ray Train's worker-group poll and raises `CollectiveHangError`.
    """

    def __init__(self, ask: Callable, num_ranks: int, detector: HangDetector,
                 wait: Callable = None, clock: Callable[[], float] = time.monotonic):
        self._ask, self._wait, self._clock = ask, wait or ray.wait, clock
        self.detector = detector
        self._pending: dict = {}  # rank -> ref
        self._next_round = -math.inf
        self._interval_s = min(15.0, max(1.0, detector.timeout_s / 10))
        self._num_ranks = num_ranks
        self._warned = False

    def poll(self) -> None:
        now = self._clock()
        self._collect(now)
        if now >= self._next_round:
            self._next_round = now + self._interval_s
            for rank in range(self._num_ranks):
                if rank not in self._pending:
                    self._pending[rank] = self._ask(rank)
                    self.detector.asked(rank, now)
        self._judge(now)

    def _collect(self, now: float) -> None:
        refs = list(self._pending.values())
        if not refs:
            return
        ready, _ = self._wait(refs, num_returns=len(refs), timeout=0)
        ready = set(ready)
        for rank, ref in list(self._pending.items()):
            if ref in ready:
                del self._pending[rank]
                try:
                    counters = ray.get(ref)
                except Exception:  # a dead worker: Ray Train's own poll reports it
                    self.detector.forget(rank)
                    continue
                self.detector.observe(rank, counters, now)

    def _judge(self, now: float) -> None:
        hang = self.detector.verdict(now)
        if hang is not None:
            who, hosts = self.detector.describe(hang.missing_ranks)
            raise CollectiveHangError(hang_message(hang, self.detector), {}, hang.missing_ranks, hosts)
        suspect = self.detector.verdict(now + self.detector.timeout_s / 2)
        warn, self._warned = suspect is not None and not self._warned, suspect is not None
        if warn:
            who, _ = self.detector.describe(suspect.missing_ranks)
            logger.warning(
                "ray_train_tpu: possible collective hang: %s behind the others, no progress for %.0f s; "
                "the attempt fails at hang_timeout_s=%g if this persists", who,
                now - self.detector._progress_at, self.detector.timeout_s,
            )


def ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    values = sorted(values)
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
