"""A termination notice on any host -> a checkpoint of every rank at the next step boundary.

Spot and preemptible TPU VMs, and GKE node drains, send SIGTERM and give a grace
period before the host goes away (30 s on GCE spot/preemptible VMs; on GKE the
pod's ``terminationGracePeriodSeconds``, capped for spot nodes by the node's
graceful-shutdown period, 30 s by default). By default a Ray worker exits at once
on SIGTERM, and the run resumes from its last periodic checkpoint, losing every
step since.

With a `PreemptionGuard` the worker instead remembers the notice, and the next
`PreemptionGuard.requested` (a collective: call it on every rank at every step
boundary) is True on *every* rank, so that all of them save the step just taken
and stop; Ray Train restarts the worker group (``FailureConfig(max_failures>=1)``)
and ``checkpoint.restore`` resumes from that step::

    with checkpoint.PreemptionGuard(grace_period_s=30) as guard:
        for step in range(start, steps):
            train_step()
            preempted = guard.requested()
            if preempted or step % every == 0:
                checkpoint.report(metrics, model=model, optimizer=opt, step=step)
            if preempted:
                guard.stop()  # raises Preempted: the retry resumes from `step`

What if the save cannot finish in time: a checkpoint is complete or absent (its
manifest is written last), so a host that is killed mid-save leaves the previous
checkpoint as the resume point, and a notice that arrives during a save never
interrupts it. If the worker is still alive when ``grace_period_s`` has passed
since the notice, it exits itself (as the host's shutdown would kill it).

Ray Train 2.60's own signal, a node that Ray Core is draining
(``ray.train.get_preemption_info``), counts as a notice too.

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
from typing import Optional

from ray_train_tpu import _validate as V

logger = logging.getLogger(__name__)

# What a worker exits with when the grace period ran out: 128 + SIGTERM, as a
# process killed by SIGTERM reports.
_GRACE_EXPIRED_EXIT_CODE = 128 + signal.SIGTERM


# How long `PreemptionGuard.stop` waits for Ray Train to collect the reports: a few of
# its polls (one every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default).
_COLLECT_TIMEOUT_S = 20.0


class Preempted(RuntimeError):
    """Raised on every rank by `PreemptionGuard.stop` once the preemption checkpoint is reported."""


class _State:
    """Per-process state shared by the signal handler (main thread) and the guard (training thread)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.installed = False
        self.previous: object = signal.SIG_DFL
        self.grace_period_s: Optional[float] = None  # armed when set
        self.noticed_at: Optional[float] = None
        self.timer: Optional[threading.Timer] = None
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
        _state.timer = threading.Timer(grace, _grace_expired)
        _state.timer.daemon = True
        _state.timer.start()
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


def _grace_expired() -> None:
    logger.error(
        "ray_train_tpu: the grace period after the termination notice is over; exiting. The last "
        "complete checkpoint stays the resume point."
    )
    logging.shutdown()
    os._exit(_GRACE_EXPIRED_EXIT_CODE)


def _reset() -> None:
    """Disarm. After a notice its deadline stays: the host is going away."""
    with _state.lock:
        if _state.noticed_at is not None:
            _state.held_until = _state.noticed_at + (_state.grace_period_s or 0.0)
        _state.grace_period_s = None
        _state.noticed_at = None


class PreemptionGuard:
    """Turn a termination notice on any host into a checkpoint of every rank.

    Args:
        grace_period_s: seconds between the notice and the host's end that this
            process may use (30 on GCE spot VMs). After it the worker exits itself.
        device: device of the flag tensor in `requested`'s all-reduce; default
            ``ray_train_tpu.get_device()``.

    Example:
        >>> with PreemptionGuard(grace_period_s=30) as guard:  # doctest: +SKIP
        ...     if guard.requested(): ...
    """

    def __init__(self, grace_period_s: float = 30.0, *, device=None):
        self.grace_period_s = float(V.check_number(
            "PreemptionGuard", "grace_period_s", grace_period_s, max=24 * 3600, unit="seconds",
            fix="use your hosts' grace period, e.g. 30 for GCE spot VMs"))
        self._device = device
        self._entered = False

    def __enter__(self) -> "PreemptionGuard":
        if not _state.installed:
            raise RuntimeError(
                "PreemptionGuard: no SIGTERM handler is installed in this worker. It is installed by "
                "TPUTorchConfig's backend: train with TPUTorchTrainer, or TorchTrainer(..., "
                "torch_config=TPUTorchConfig()); elsewhere call "
                "ray_train_tpu.checkpoint.preemption.install_handler() on the process's main thread first."
            )
        with _state.lock:
            _state.grace_period_s = self.grace_period_s
            _state.noticed_at = None
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        self._entered = False
        _reset()

    def noticed(self) -> bool:
        """True if *this* process received a notice (no communication)."""
        return _state.noticed_at is not None

    def requested(self) -> bool:
        """True on every rank if any rank received a notice. A collective: call it on
        every rank at the same step boundaries."""
        import torch
        import torch.distributed as dist

        if not self._entered:
            raise RuntimeError("PreemptionGuard.requested() outside `with PreemptionGuard(...)`")
        local = self.noticed() or _ray_preemption_pending()
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=self._flag_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stop(self) -> None:
        """End this attempt on every rank after the preemption checkpoint was reported.

        First waits (within the grace period, at most `_COLLECT_TIMEOUT_S`) until Ray
        Train's controller has collected this worker's reports: it stops collecting
        at the first error, and a checkpoint it never collected is not resumed from."""
        from ray_train_tpu._compat import ray_train as compat_ray

        left = None
        if _state.noticed_at is not None:
            left = self.grace_period_s - (time.monotonic() - _state.noticed_at)
        collected = compat_ray.wait_for_reports_collected(
            max(0.0, min(_COLLECT_TIMEOUT_S, left if left is not None else _COLLECT_TIMEOUT_S)))
        if not collected:
            logger.warning("ray_train_tpu: Ray Train had not collected the preemption checkpoint's report "
                           "when this worker stopped; the retry may resume from an earlier checkpoint")
        if left is not None:
            left = self.grace_period_s - (time.monotonic() - _state.noticed_at)
        raise Preempted(
            "stopped for a termination notice after reporting a checkpoint"
            + (f" ({left:.1f} s of the grace period left on this host)" if left is not None else
               " (the notice came from another host)")
            + "; Ray Train's FailureConfig(max_failures>=1) restarts the workers, and "
              "checkpoint.restore resumes from that checkpoint"
        )

    def _flag_device(self):
        if self._device is None:
            from ray_train_tpu.device import get_device

            self._device = get_device()
        return self._device


def _ray_preemption_pending() -> bool:
    """Ray Train's own notice for this worker (a node Ray Core is draining, e.g. by
    KubeRay), read locally so that `requested` needs no second barrier."""
    from ray_train_tpu._compat import ray_train as compat_ray

    return compat_ray.preemption_pending()
