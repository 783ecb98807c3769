"""PreemptionGuard: a SIGTERM on one rank -> every rank's `requested()` is True at the
next step boundary; unarmed, SIGTERM does what it did before; a worker still alive
when the grace period ends exits itself."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ray_train_tpu.checkpoint import preemption
from ray_train_tpu.testing import gloo as _spawn


def _notice_on_rank_1(rank, world_size):
    import torch
    import torch.distributed as dist

    preemption.install_handler()
    out = {}
    with preemption.PreemptionGuard(grace_period_s=60, device=torch.device("cpu")) as guard:
        out["before"] = guard.requested()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the guard is armed
        dist.barrier()
        out["noticed"] = guard.noticed()
        out["after"] = guard.requested()
        try:
            guard.stop()
        except preemption.Preempted as e:
            out["stopped"] = str(e)
    out["disarmed"] = not preemption._state.noticed_at and preemption._state.grace_period_s is None
    return out


def test_a_notice_on_one_rank_is_requested_on_every_rank():
    results = _spawn.run(_notice_on_rank_1, 2)
    assert [r["before"] for r in results] == [False, False]
    assert [r["noticed"] for r in results] == [False, True]
    assert [r["after"] for r in results] == [True, True]
    assert "another host" in results[0]["stopped"]
    assert "grace period left on this host" in results[1]["stopped"]
    assert all(r["disarmed"] for r in results)


def _unarmed_passes_sigterm_on(rank, world_size):
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append("ray's handler"))
    preemption.install_handler()
    os.kill(os.getpid(), signal.SIGTERM)  # no guard yet: passed on
    with preemption.PreemptionGuard(grace_period_s=60):
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # guard gone, no notice taken: passed on again
    with preemption.PreemptionGuard(grace_period_s=60) as guard:
        os.kill(os.getpid(), signal.SIGTERM)  # taken by the guard
        noticed = guard.noticed()
    os.kill(os.getpid(), signal.SIGTERM)  # within that notice's grace period: held
    return got, noticed


def test_without_an_armed_guard_sigterm_reaches_the_previous_handler():
    assert _spawn.run(_unarmed_passes_sigterm_on, 1) == [(["ray's handler", "ray's handler"], True)]


def test_a_worker_still_alive_after_the_grace_period_exits_itself():
    script = textwrap.dedent("""
        import os, signal, time
        from ray_train_tpu.checkpoint import preemption
        preemption.install_handler()
        with preemption.PreemptionGuard(grace_period_s=0.5):
            os.kill(os.getpid(), signal.SIGTERM)
            print("alive after the notice", flush=True)
            time.sleep(30)
        print("not reached", flush=True)
    """)
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stdout == "alive after the notice\n"
    assert "grace period after the termination notice is over" in proc.stderr
    assert time.monotonic() - start < 25


def test_a_guard_needs_the_handler(monkeypatch):
    monkeypatch.setattr(preemption, "_state", preemption._State())
    with pytest.raises(RuntimeError, match="TPUTorchConfig"):
        with preemption.PreemptionGuard():
            pass


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "30", 10**6])
def test_grace_period_must_be_finite_positive_seconds(bad):
    with pytest.raises(ValueError, match="grace_period_s"):
        preemption.PreemptionGuard(grace_period_s=bad)


def test_install_handler_refuses_other_threads():
    import threading

    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(preemption.install_handler)))
    t.start()
    t.join()
    assert "main thread" in str(errors[0])


def _catch(fn):
    try:
        fn()
    except RuntimeError as e:
        return e


class _FakeContext:
    def __init__(self, results):
        self.execution_context = type("E", (), {"result_queue": results})()


def test_stop_waits_until_ray_train_collected_the_reports(monkeypatch):
    """Ray Train's controller stops collecting at the first error: the preemption
    checkpoint's report must be taken from the queue before the attempt ends."""
    import queue
    import threading

    from ray_train_tpu._compat import ray_train as compat_ray

    results = queue.Queue()
    results.put("step 3 report")
    results.put("preemption report")
    monkeypatch.setattr(compat_ray, "_train_context", lambda: _FakeContext(results))

    def controller_polls():  # one report per poll
        for _ in range(2):
            time.sleep(0.3)
            results.get_nowait()
            results.task_done()

    poller = threading.Thread(target=controller_polls)
    start = time.monotonic()
    poller.start()
    with pytest.raises(preemption.Preempted):
        preemption.PreemptionGuard(grace_period_s=30).stop()
    assert time.monotonic() - start >= 0.55 and results.unfinished_tasks == 0
    poller.join()


def test_waiting_for_the_reports_is_bounded(monkeypatch):
    import queue

    from ray_train_tpu._compat import ray_train as compat_ray

    results = queue.Queue()
    results.put("never collected")
    monkeypatch.setattr(compat_ray, "_train_context", lambda: _FakeContext(results))
    start = time.monotonic()
    assert compat_ray.wait_for_reports_collected(0.3) is False
    assert 0.3 <= time.monotonic() - start < 5
    monkeypatch.setattr(compat_ray, "_train_context", lambda: None)  # not in a Ray Train worker
    assert compat_ray.wait_for_reports_collected(10) is True
