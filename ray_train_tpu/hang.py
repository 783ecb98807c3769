"""Hang detection inside a step: a collective that some ranks never join, or a loop that stopped stepping, fails the attempt.

Ray Train 2.60's user-facing reference is its NCCL hang detector
(``train/v2/_internal/callbacks/nccl_ras.py``): the controller polls every
rank's collective counters, and a communicator whose ranks disagree and that
made no progress for a while is a hang; it raises ``NCCLHangError`` (a
``WorkerGroupError``), which Ray Train's failure policy retries against
``FailureConfig(max_failures)``, from the last checkpoint. NCCL RAS exists
only on GPUs, and c10d numbers collectives only for its built-in backend
types (torch_tpu's ``tpu_dist`` is a custom one, without sequence numbers), so
each worker counts its own collective entries per process group at the
dispatcher (`ray_train_tpu._compat.torch.install_collective_counter`: every
``c10d`` and functional collective, DDP's C++ all-reduces included), and its
optimizer steps (``register_optimizer_step_post_hook``).

`TPUTorchConfig(hang_timeout_s=...)` turns it on (default 600 s; None turns it
off). After the process group is up, the backend hooks a watch into Ray Train's
worker-group poll (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s): it asks
every rank for its progress (a light actor call, answered while the training
thread waits in a collective), and when no rank entered a collective or took a
step for ``hang_timeout_s`` and

- some ranks are behind the others in a group (a rank that left the loop
  early, a collective in a branch only some ranks take, a rank stuck in its
  own work), or have not answered at all (a frozen process or host), or
- the loop has stepped before (or resumed from a checkpoint) and every rank
  agrees, but none steps any more (a loop that spins without steps),

it raises `CollectiveHangError` naming those ranks, their hosts and, per rank,
the Python frame its training thread waits in (read in the worker, or with
``py-spy dump`` from the host for a rank that does not answer). Half-way there
it logs a warning.

Every rank busy in a long computation with equal counters is not a hang as
long as the job has not stepped yet (a fresh run's first-step compile); after a
step or a resume, no step and no collective anywhere for ``hang_timeout_s``
is, and a rank that is still computing while the others wait for it longer
than ``hang_timeout_s`` is, so the timeout must exceed the longest step,
compile or checkpoint save.

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

    missing_ranks: tuple  # behind in a group, or not answering; every rank for a loop without steps
    unresponsive_ranks: tuple  # did not answer at all (a frozen process or host)
    waiting: dict  # group name -> (collective number the leaders wait in, ranks that wait)
    stalled_s: float
    finished_ranks: tuple = ()  # ranks whose training function had returned (left the loop early)
    no_step: bool = False  # every rank agrees, and none stepped or entered a collective


class HangDetector:
    """Pure bookkeeping: per-rank progress in, a `Hang` out (no Ray, no clock).

    Args:
        timeout_s: how long no rank may enter a collective or take a step.
        hosts: host of each rank (its description in messages), rank order.
        now: the time the watch starts (training start).
    """

    def __init__(self, timeout_s: float, hosts: Sequence[str], now: float):
        self.timeout_s = float(timeout_s)
        self.hosts = list(hosts)
        self._counters: dict = {}  # rank -> {group: (ranks, seq)}
        self._steps: dict = {}  # rank -> optimizer steps taken
        self._armed = False  # some rank stepped or resumed: a loop without steps is now a hang
        self._finished: set = set()  # ranks whose training function returned
        self.frames: dict = {}  # rank -> where its training thread was, last seen
        self._progress_at = now  # last time any rank's counters changed
        self._asked_at: dict = {}  # rank -> time of its unanswered question

    def asked(self, rank: int, now: float) -> None:
        self._asked_at.setdefault(rank, now)

    def forget(self, rank: int) -> None:
        """A rank whose worker died: Ray Train's own poll reports that failure."""
        self._asked_at.pop(rank, None)
        self._counters.pop(rank, None)
        self._steps.pop(rank, None)

    def observe(self, rank: int, counters: dict, now: float, steps: int = 0, resumed: bool = False,
                finished: bool = False, frame: Optional[str] = None) -> None:
        """Rank `rank` answered: `counters` ({group: (ranks, collectives entered)}),
        optimizer `steps` taken, whether the attempt `resumed` from a checkpoint,
        whether its training function `finished`, and its training thread's `frame`."""
        self._asked_at.pop(rank, None)
        if self._counters.get(rank) != counters or self._steps.get(rank, 0) != steps:
            self._counters[rank], self._steps[rank] = counters, steps
            self._progress_at = now
        self._armed = self._armed or steps > 0 or resumed
        (self._finished.add if finished else self._finished.discard)(rank)
        if frame:
            self.frames[rank] = frame

    def stalled_s(self, now: float) -> float:
        return now - self._progress_at

    def verdict(self, now: float) -> Optional[Hang]:
        stalled = now - self._progress_at
        if stalled < self.timeout_s:
            return None
        unresponsive = tuple(sorted(r for r, t in self._asked_at.items() if now - t >= self.timeout_s))
        behind, waiting = self._behind()
        missing = tuple(sorted(set(behind) | set(unresponsive)))
        finished = tuple(sorted(self._finished & set(missing)))
        if missing:
            return Hang(missing, unresponsive, waiting, stalled, finished)
        if self._armed and self._counters:
            # every rank answers and agrees, none steps: a loop that spins (or a step longer than the timeout)
            return Hang(tuple(sorted(self._counters)), (), {}, stalled, tuple(sorted(self._finished)), no_step=True)
        return None  # every rank busy alone before the first step (a compile): not a hang

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


def hang_message(hang: Hang, detector: HangDetector, frames: Optional[dict] = None) -> str:
    """The error's text; `frames` (rank -> where its training thread waits)
    defaults to what the detector saw last."""
    who, _ = detector.describe(hang.missing_ranks)
    frames = {**detector.frames, **(frames or {})}
    if hang.no_step:
        parts = [f"ray_train_tpu: training hang: no rank took a step or entered a collective for "
                 f"{hang.stalled_s:.0f} s (hang_timeout_s={detector.timeout_s:g}), {who} (a loop that spins "
                 "without steps, e.g. over a loader with no batches left, or a step longer than the timeout)"]
    else:
        parts = [f"ray_train_tpu: collective hang: {who} did not join"]
        if hang.waiting:
            name, (seq, leaders) = next(iter(sorted(hang.waiting.items())))
            parts.append(f" collective #{seq} of process group {name!r}, in which rank(s) {ranges(leaders)} waited")
        else:
            parts.append(" the job's collectives")
        parts.append(f"; no rank made progress for {hang.stalled_s:.0f} s (hang_timeout_s={detector.timeout_s:g})")
        if hang.finished_ranks:
            parts.append(f"; rank(s) {ranges(hang.finished_ranks)} had returned from the training function "
                         "(left the loop early)")
        if hang.unresponsive_ranks:
            parts.append(f"; rank(s) {ranges(hang.unresponsive_ranks)} did not even answer (a frozen process or host)")
    # the missing ranks first, then those that wait for them
    shown = list(hang.missing_ranks) + sorted(set(frames) - set(hang.missing_ranks))
    where = [f"rank {r} ({detector.hosts[r] if r < len(detector.hosts) else '?'}): {frames[r]}"
             for r in shown if r in frames][:_MAX_FRAMES]
    if where:
        parts.append(". Where each training thread waits: " + "; ".join(where))
    parts.append(
        ". The attempt fails; Ray Train retries it from the last checkpoint against "
        "FailureConfig(max_failures). Look at those hosts (a stalled TPU, a rank that left the "
        "loop early, a collective in a branch only some ranks take, a loop without steps), or raise "
        "TPUTorchConfig(hang_timeout_s=...) if a step, compile or save legitimately takes that long."
    )
    return "".join(parts)


_MAX_FRAMES = 8  # ranks whose frames a message shows


class CollectiveWatch:
    """Asks every rank for its progress without blocking and feeds a `HangDetector`.

    `ask(rank)` returns an ObjectRef of that rank's `worker_progress` (the
    backend uses ``worker_group.execute_single_async``); `wait` is ``ray.wait``.
    `dump(pid, node_id)`, when given, returns an ObjectRef of the frame of a
    process that does not answer (``py-spy dump`` on its host, `py_spy_frame`);
    it is started at the half-way warning and read at the verdict. `poll` is
    called from Ray Train's worker-group poll and raises `CollectiveHangError`.
    """

    def __init__(self, ask: Callable, num_ranks: int, detector: HangDetector,
                 wait: Callable = None, clock: Callable[[], float] = time.monotonic,
                 dump: Optional[Callable] = None):
        self._ask, self._wait, self._clock, self._dump = ask, wait or ray.wait, clock, dump
        self.detector = detector
        self._pending: dict = {}  # rank -> ref
        self._next_round = -math.inf
        self._interval_s = min(15.0, max(1.0, detector.timeout_s / 10))
        self._num_ranks = num_ranks
        self._warned = False
        self._where: dict = {}  # rank -> (pid, node id), from its answers
        self._dumps: dict = {}  # rank -> ref of its py-spy frame

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
                    answer = ray.get(ref)
                except Exception:  # a dead worker: Ray Train's own poll reports it
                    self.detector.forget(rank)
                    continue
                if "collectives" not in answer:  # a bare {group: (ranks, count)}
                    answer = {"collectives": answer}
                if answer.get("pid") is not None:
                    self._where[rank] = (answer["pid"], answer.get("node_id"))
                self.detector.observe(rank, answer["collectives"], now, steps=answer.get("steps", 0),
                                      resumed=answer.get("resumed", False), finished=answer.get("finished", False),
                                      frame=answer.get("frame"))

    def _judge(self, now: float) -> None:
        hang = self.detector.verdict(now)
        if hang is not None:
            who, hosts = self.detector.describe(hang.missing_ranks)
            message = hang_message(hang, self.detector, self._dumped_frames(hang.unresponsive_ranks))
            raise CollectiveHangError(message, {}, hang.missing_ranks, hosts)
        suspect = self.detector.verdict(now + self.detector.timeout_s / 2)
        warn, self._warned = suspect is not None and not self._warned, suspect is not None
        if warn:
            self._start_dumps(suspect.unresponsive_ranks)
            who, _ = self.detector.describe(suspect.missing_ranks)
            logger.warning(
                "ray_train_tpu: possible hang: %s %s, no progress for %.0f s; the attempt fails at "
                "hang_timeout_s=%g if this persists", who,
                "take no step" if suspect.no_step else "behind the others", self.detector.stalled_s(now),
                self.detector.timeout_s,
            )

    def _start_dumps(self, ranks) -> None:
        if self._dump is None:
            return
        for rank in ranks:
            if rank in self._where and rank not in self._dumps:
                try:
                    self._dumps[rank] = self._dump(*self._where[rank])
                except Exception as e:  # best effort: the verdict does not depend on it
                    logger.info("ray_train_tpu: no py-spy dump of rank %d: %s", rank, e)

    def _dumped_frames(self, ranks, wait_s: float = 5.0) -> dict:
        self._start_dumps(ranks)  # ranks that stopped answering only after the warning
        refs = {r: self._dumps[r] for r in ranks if r in self._dumps}
        if not refs:
            return {}
        ready, _ = self._wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
        out = {}
        for rank, ref in refs.items():
            if ref in ready:
                try:
                    frame = ray.get(ref)
                except Exception as e:
                    logger.info("ray_train_tpu: no py-spy dump of rank %d: %s", rank, e)
                    continue
                if frame:
                    out[rank] = f"{frame} (py-spy)"
        return out


# -- worker side: what each rank answers (runs in the Ray Train worker, on the actor's thread)

_TRAINING_THREAD = "TrainingThread("  # Ray Train 2.60's name of the thread that runs the training function
_steps = [0]


def install_worker_probes() -> None:
    """Start counting this process's collective entries and optimizer steps
    (before the training function starts; idempotent)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ray_train_tpu._compat import torch as compat_torch

    compat_torch.install_collective_counter()
    if not getattr(install_worker_probes, "_hooked", False):
        register_optimizer_step_post_hook(lambda *_: _steps.__setitem__(0, _steps[0] + 1))
        install_worker_probes._hooked = True


def worker_progress() -> dict:
    """This rank's answer to the watch: collectives entered per group, optimizer
    steps, whether the attempt resumed from a checkpoint, whether the training
    function returned, where the training thread is, its pid and node."""
    import os
    import threading

    from ray_train_tpu._compat import torch as compat_torch

    thread = next((t for t in threading.enumerate() if t.name.startswith(_TRAINING_THREAD)), None)
    resumed, node_id = False, None
    if ray.is_initialized():  # else not a Ray worker (a test): never start Ray here
        node_id = ray.get_runtime_context().get_node_id()
        try:
            resumed = ray.train.get_checkpoint() is not None
        except Exception:  # not inside a Ray Train worker
            pass
    return {
        "collectives": compat_torch.collective_entries(),
        "steps": _steps[0],
        "resumed": resumed,
        "finished": thread is None or not thread.is_alive(),
        "frame": _thread_frame(thread),
        "pid": os.getpid(),
        "node_id": node_id,
    }


def _thread_frame(thread) -> Optional[str]:
    import sys
    import traceback

    if thread is None:
        return "no training thread (the training function returned)"
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return None
    stack = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame)]
    return summarize_stack(stack[::-1])


def summarize_stack(innermost_first: Sequence[tuple]) -> Optional[str]:
    """``"all_reduce (torch/distributed/distributed_c10d.py:2950) in _train (train.py:42)"``:
    the innermost frame and, where it is library code, the innermost frame of
    the user's code that led there. `innermost_first`: (file, line, function)."""
    if not innermost_first:
        return None
    top = innermost_first[0]
    text = f"{top[2]} ({_short(top[0])}:{top[1]})"
    user = next((f for f in innermost_first if _is_user_file(f[0])), None)
    if user is not None and user is not top:
        text += f" in {user[2]} ({_short(user[0])}:{user[1]})"
    return text


def _library_roots() -> tuple:
    import os
    import sysconfig

    here = os.path.dirname(os.path.abspath(__file__))
    return tuple(p for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                             sysconfig.get_paths()["platlib"], here} if p)


def _is_user_file(path: str) -> bool:
    return not (path.startswith(_library_roots()) or "site-packages" in path or path.startswith("<"))


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python"):
        if marker in path:
            return path.split(marker, 1)[1].split("/", 1)[-1] if marker == "/lib/python" else path.split(marker, 1)[1]
    return path


def py_spy_frame(pid: int, timeout_s: float = 15.0) -> Optional[str]:
    """Where process `pid`'s training thread is, read from the outside with
    ``py-spy dump --nonblocking`` (it reads the memory of a frozen process
    too; py-spy comes with ``ray[default]``). Runs on the host of `pid`."""
    import shutil
    import subprocess
    import sys
    import os

    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = subprocess.run([exe, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)],
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"py-spy dump --pid {pid} failed: {out.stderr.strip()[-300:]}")
    return summarize_stack(parse_py_spy_thread(out.stdout, _TRAINING_THREAD))


def parse_py_spy_thread(dump: str, name_prefix: str) -> list:
    """(file, line, function) of the thread whose name starts with
    `name_prefix` in a ``py-spy dump`` text, innermost first."""
    import re

    frames, inside = [], False
    for line in dump.splitlines():
        if line.startswith("Thread "):
            if inside:
                break
            inside = f'"{name_prefix}' in line
            continue
        m = re.match(r"\s+(.+?) \((.+):(\d+)\)\s*$", line) if inside else None
        if m:
            frames.append((m.group(2), int(m.group(3)), m.group(1)))
    return frames


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
