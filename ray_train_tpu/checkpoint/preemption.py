"""Preemption on Ray Train's own machinery: a notice -> a just-in-time checkpoint
of every rank -> a restart charged to ``FailureConfig(max_preemption_failures)``.

What Ray 2.60 does (and this module builds on):

- Ray Core *drains* a node that is about to go away, with a deadline: ``ray
  start`` does it itself on SIGTERM (for ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``,
  30 s), KubeRay's autoscaler before it deletes a pod, ``ray drain-node`` by hand.
- Ray Train's PreemptionWatcher sees the drain (every
  ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``, 5 s) and tells every worker of the
  job (``ray.train.get_preemption_info()``; on TPU the whole slice at once).
- The controller waits until every worker exited or the deadline (plus
  ``FailureConfig(preemption_grace_s)``) passed, then restarts the run from its
  latest checkpoint, charged to ``max_preemption_failures``, not ``max_failures``.
  With an elastic ``num_slices=(min, max)`` the restart runs on the slices left.

What `PreemptionGuard` adds, and only that:

1. **A SIGTERM at the worker is a notice, not a death.** A spot VM's shutdown
   signals every process, workers included, while ``ray start`` drains the node;
   Ray's own handler makes the worker exit at once. With a guard armed the
   worker lives on, and its SIGTERM counts at the next `requested` (before Ray's
   watcher has polled the drain).
2. **A cheap per-step check, without a host sync.** `requested` starts a
   non-blocking 4-byte all-reduce of this rank's flag (its own SIGTERM, or
   Ray's notice) on a host (gloo) group of its own, and returns the result of
   the one it started at the previous check: True on every rank at the same
   step, one check after any rank had a notice. Nothing waits for the device
   (the flag never goes there, so an asynchronous TPU or GPU queue is not
   drained each step) nor for a collective started in the same step.
   ``check_every=N`` checks at every N-th call only (the calls in between cost
   nothing). ``ray.train.get_preemption_info()`` is a barrier through the
   controller's actor at every call.
3. **An end Ray counts as a preemption.** After the checkpoint the attempt must
   not end in an exception (Ray charges a worker error to ``max_failures``) nor
   return (the run would be finished). `stop` waits until Ray Train knows of the
   preemption and has collected the checkpoint's report, then parks the worker
   until Ray tears the group down at the deadline.

The guard never drains a node itself: Ray also SIGTERMs workers when it tears a
group down (removing its placement group), and a drain asked for then would
take a healthy host out of the job. A SIGTERM without Ray's notice (no drain
within a few seconds) ends the attempt with `Preempted` after the checkpoint.

Removed because Ray does it: the guard's own timer that exited a worker when
its grace period ran out (Ray tears the group down at the drain's deadline),
and ending every preemption by raising `Preempted`, which Ray charged to
``max_failures``.

Usage, on every rank::

    with checkpoint.PreemptionGuard(grace_period_s=30) as guard:
        for step in range(start, steps):
            train_step()
            preempted = guard.requested()
            if preempted or step % every == 0:
                checkpoint.report(metrics, model=model, optimizer=opt, step=step)
            if preempted:
                guard.stop()  # parks until Ray restarts the run from that checkpoint

A checkpoint is complete or absent (its manifest is written last), so a host
that is killed mid-save leaves the previous checkpoint as the resume point, and
a notice that arrives during a save never interrupts it.

The SIGTERM handler is installed on every worker's main thread by
`TPUTorchConfig`'s backend (the training function runs in another thread, where
Python cannot install signal handlers); until a guard is armed it passes SIGTERM
on to the handler it replaced (Ray's: exit), so nothing changes for loops that do
not use it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import NoReturn, Optional

from ray_train_tpu import _validate as V

logger = logging.getLogger(__name__)

# How long `stop` waits for Ray Train to collect the reports: a few of its polls
# (one every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default).
_COLLECT_TIMEOUT_S = 20.0
# How long `stop` waits for Ray Train's own notice after a SIGTERM: its
# PreemptionWatcher polls the drain state every 5 s by default.
_RAY_NOTICE_TIMEOUT_S = 15.0


class Preempted(RuntimeError):
    """Raised by `PreemptionGuard.stop` only when Ray Train never learned of the
    notice; Ray then counts the restart against ``FailureConfig(max_failures)``."""


class _State:
    """Per-process state shared by the signal handler (main thread) and the guard (training thread)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.installed = False
        self.previous: object = signal.SIG_DFL
        self.grace_period_s: Optional[float] = None  # armed when set
        self.noticed_at: Optional[float] = None
        self.wakeup: Optional[tuple] = None  # keeps the socket pair alive
        self.held_until = float("-inf")  # a taken notice's deadline, after disarming


_state = _State()


def install_handler() -> None:
    """Install the SIGTERM handler. Must run on the process's main thread (idempotent).

    Python runs signal handlers on the main thread only, and only when that thread
    next executes Python code; a Ray worker's main thread waits in C++ for its next
    task, so the handler alone could learn of a notice seconds late. The C-level
    handler also writes each signal's number to the wakeup fd at once, from any
    thread: a watcher thread reads it and records the notice immediately.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("preemption.install_handler must run on the main thread (Python's signal rule)")
    with _state.lock:
        if _state.installed:
            return
        _state.previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        # Someone (an asyncio loop) had the wakeup fd: keep feeding it.
        forward = None if previous_fd == -1 else previous_fd
        _state.wakeup = (reader, writer)
        threading.Thread(target=_watch, args=(reader, forward), daemon=True,
                         name="ray_train_tpu-preemption").start()
        _state.installed = True


def _watch(reader: socket.socket, forward: Optional[int]) -> None:
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        if forward is not None:
            try:
                os.write(forward, data)
            except OSError:
                pass
        if signal.SIGTERM in data:
            _notice()


def handler_installed() -> bool:
    return _state.installed


def _notice() -> bool:
    """Record a notice if a guard is armed; True if one is."""
    with _state.lock:
        grace = _state.grace_period_s
        if grace is None or _state.noticed_at is not None:
            return grace is not None
        _state.noticed_at = time.monotonic()
    logger.warning(
        "ray_train_tpu: termination notice (SIGTERM) on pid %d; every rank checkpoints at the next "
        "step boundary (grace period %.0f s)", os.getpid(), grace,
    )
    return True


def _on_sigterm(signum, frame) -> None:
    # The Python-level handler may run long after the watcher thread saw the signal,
    # even after the guard was disarmed: a notice already taken is not passed on.
    if not _notice() and time.monotonic() >= _state.held_until:
        _pass_on(signum, frame)


def _pass_on(signum, frame) -> None:
    """Do what would have happened without us."""
    previous = _state.previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    # SIG_IGN: ignore, as before.


def _reset() -> None:
    """Disarm. After a notice its deadline stays: the host is going away."""
    with _state.lock:
        if _state.noticed_at is not None:
            _state.held_until = _state.noticed_at + (_state.grace_period_s or 0.0)
        _state.grace_period_s = None
        _state.noticed_at = None


class PreemptionGuard:
    """Turn a termination notice on any host into a checkpoint of every rank and
    a restart that Ray Train charges to ``FailureConfig(max_preemption_failures)``.

    Args:
        grace_period_s: seconds between a SIGTERM and the host's end (30 on GCE
            spot VMs); within it `stop` waits for Ray's notice and its reports.
        check_every: `requested` checks at every `check_every`-th call (on every
            rank the same calls); a notice is seen at most ``2 * check_every``
            calls after it arrived.
        device: ignored (with a warning): the flags travel on a host group.

    Example:
        >>> with PreemptionGuard(grace_period_s=30) as guard:  # doctest: +SKIP
        ...     if guard.requested(): ...
    """

    def __init__(self, grace_period_s: float = 30.0, *, check_every: int = 1, device=None):
        self.grace_period_s = float(V.check_number(
            "PreemptionGuard", "grace_period_s", grace_period_s, max=24 * 3600, unit="seconds",
            fix="use your hosts' grace period, e.g. 30 for GCE spot VMs"))
        self.check_every = V.check_int("PreemptionGuard", "check_every", check_every, min=1,
                                       fix="e.g. check_every=10 to check at every 10th step")
        if device is not None:
            logger.warning("ray_train_tpu: ignoring PreemptionGuard(device=%r): the notice flags travel on a "
                           "host (gloo) group, never on the device", device)
        self._entered = False
        self._calls = 0
        self._group = None
        self._pending = None  # (work, flag) of the all-reduce started at the last check

    def __enter__(self) -> "PreemptionGuard":
        if not _state.installed:
            raise RuntimeError(
                "PreemptionGuard: no SIGTERM handler is installed in this worker. It is installed by "
                "TPUTorchConfig's backend: train with TPUTorchTrainer, or TorchTrainer(..., "
                "torch_config=TPUTorchConfig()); elsewhere call "
                "ray_train_tpu.checkpoint.preemption.install_handler() on the process's main thread first."
            )
        self._group = _flag_group()
        self._calls, self._pending = 0, None
        with _state.lock:
            _state.grace_period_s = self.grace_period_s
            _state.noticed_at = None
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        self._entered = False
        self._pending = None  # every rank started it: it completes without us
        _reset()

    def noticed(self) -> bool:
        """True if *this* process received a SIGTERM notice (no communication)."""
        return _state.noticed_at is not None

    def requested(self) -> bool:
        """True on every rank if any rank has a notice (its SIGTERM, or Ray's),
        read one check late: the result of the all-reduce started at the previous
        check, while this check's starts without blocking. A collective: call it
        on every rank at the same step boundaries."""
        import torch
        import torch.distributed as dist

        from ray_train_tpu._compat import ray_train as compat_ray

        if not self._entered:
            raise RuntimeError("PreemptionGuard.requested() outside `with PreemptionGuard(...)`")
        self._calls += 1
        if self._calls % self.check_every:
            return False
        local = self.noticed() or compat_ray.preemption_pending()
        if self._group is None:  # one process: nothing to agree on
            return local
        previous = self._pending
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        if previous is None:
            return False
        work, answer = previous
        work.wait()  # started a check ago: done by now, short of a rank that is behind
        return bool(answer.item())

    def stop(self) -> NoReturn:
        """End this attempt after the preemption checkpoint was reported (every rank).

        Waits until Ray Train knows of the preemption (its PreemptionWatcher tells
        every worker) and has collected this worker's reports, then parks until
        Ray tears the worker group down at the deadline; the restart resumes from
        the checkpoint and counts against ``max_preemption_failures``. Raises
        `Preempted` if Ray never learned of the notice."""
        from ray_train_tpu._compat import ray_train as compat_ray

        known = compat_ray.in_train_worker() and _wait_for(
            compat_ray.preemption_pending, self._time_left(_RAY_NOTICE_TIMEOUT_S))
        deadline = compat_ray.preemption_deadline_s() if known else None
        budget = deadline if deadline is not None else self._time_left(_COLLECT_TIMEOUT_S)
        collected = compat_ray.wait_for_reports_collected(max(0.0, min(_COLLECT_TIMEOUT_S, budget)))
        if not collected:
            logger.warning("ray_train_tpu: Ray Train had not collected the preemption checkpoint's report "
                           "when this worker stopped; the retry may resume from an earlier checkpoint")
        if not known:
            raise Preempted(
                "stopped for a termination notice after reporting a checkpoint, but Ray Train never learned of "
                "the preemption (no drain of the node: `ray start` drains it on SIGTERM, KubeRay before it "
                "deletes a pod); Ray Train counts this restart against FailureConfig(max_failures)")
        logger.info("ray_train_tpu: preemption checkpoint reported; waiting for Ray Train to restart the run "
                    "at the preemption deadline%s", "" if deadline is None else f" (in {deadline:.0f} s)")
        while True:  # Ray Train kills this worker at the deadline (or when every worker exited)
            time.sleep(1.0)

    def _time_left(self, cap: float) -> float:
        if _state.noticed_at is None:
            return cap
        return max(0.0, min(cap, self.grace_period_s - (time.monotonic() - _state.noticed_at)))


# The host group `requested` all-reduces its flags on, per default process group.
_flag_groups: dict = {}


def _flag_group():
    """A gloo group over every rank of the default process group (created once per
    group; a collective, as `PreemptionGuard.__enter__` runs on every rank), or
    ``None`` without one or with one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    default = dist.group.WORLD
    if _flag_groups.get("default") is not default:
        _flag_groups.update(default=default, group=dist.new_group(backend="gloo"))
    return _flag_groups["group"]


def _wait_for(condition, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True
