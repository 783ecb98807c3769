"""PreemptionGuard: a SIGTERM on one rank -> every rank's `requested()` is True at the
next step boundary (and nothing is asked of Ray); unarmed, SIGTERM does what it did before; `stop()` parks the worker when Ray Train knows of the preemption (Ray then
restarts the run, charged to max_preemption_failures) and raises only when it does not."""

import logging
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
    import torch.distributed as dist

    preemption.install_handler()
    out, started = {}, []
    real = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        started.append((str(tensor.device), async_op, dist.get_backend(group)))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    with preemption.PreemptionGuard(grace_period_s=60) as guard:
        out["before"] = guard.requested()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the guard is armed
        dist.barrier()
        out["noticed"] = guard.noticed()
        out["next"] = guard.requested()  # reads the check started before the notice
        out["after"] = guard.requested()
        try:
            guard.stop()
        except preemption.Preempted as e:
            out["stopped"] = str(e)
    out["disarmed"] = not preemption._state.noticed_at and preemption._state.grace_period_s is None
    out["started"], started[:] = list(started), []
    with preemption.PreemptionGuard(grace_period_s=60, check_every=3) as guard:
        out["every_3"] = []
        for call in range(1, 10):
            if call == 4:
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                dist.barrier()
            out["every_3"].append(guard.requested())
    out["started_every_3"] = len(started)
    dist.all_reduce = real
    out["default_backend"] = dist.get_backend()
    return out


def test_a_notice_on_one_rank_is_requested_on_every_rank_one_check_late_without_blocking():
    """On the simulated tpu_dist group: `requested` starts a non-blocking
    all-reduce of a host flag on a gloo group at each check and answers with the
    previous check's, so every rank sees a notice at the same call, one check
    after it; ``check_every=3`` starts one all-reduce per 3 calls."""
    results = _spawn.run(_notice_on_rank_1, 2, simulate_tpu=True)
    assert [r["default_backend"] for r in results] == ["tpu_dist", "tpu_dist"]
    assert [r["before"] for r in results] == [False, False]
    assert [r["noticed"] for r in results] == [False, True]
    assert [r["next"] for r in results] == [False, False]
    assert [r["after"] for r in results] == [True, True]
    assert all(r["started"] == [("cpu", True, "gloo")] * 3 for r in results), results[0]["started"]
    # Outside a Ray Train worker Ray cannot learn of it: stop() says so and raises.
    assert all("Ray Train never learned of the preemption" in r["stopped"] for r in results)
    assert all(r["disarmed"] for r in results)
    assert all(r["every_3"] == [False] * 8 + [True] for r in results), [r["every_3"] for r in results]
    assert all(r["started_every_3"] == 3 for r in results)


def test_check_every_is_a_positive_integer_and_device_is_ignored_with_a_warning(caplog):
    with pytest.raises(ValueError, match="check_every"):
        preemption.PreemptionGuard(check_every=0)
    with caplog.at_level(logging.WARNING):
        preemption.PreemptionGuard(device="cpu")
    assert "ignoring PreemptionGuard(device='cpu')" in caplog.text


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


def test_a_sigterm_is_a_local_notice_and_never_a_drain():
    """Ray SIGTERMs workers when it tears a group down, too: the guard keeps the worker
    alive and notes the notice, but asks Ray for nothing (a drain would take the host out)."""
    script = textwrap.dedent("""
        import os, signal, time
        from ray_train_tpu._compat import ray_train as compat_ray
        from ray_train_tpu.checkpoint import preemption
        calls = []
        compat_ray.drain_node = lambda *a, **k: calls.append(a) or (True, "")
        preemption.install_handler()
        with preemption.PreemptionGuard(grace_period_s=12) as guard:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still one notice
            time.sleep(0.5)
            print(guard.noticed(), calls, flush=True)
    """)
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "True []\n"
    assert proc.stderr.count("termination notice (SIGTERM)") == 1


def _patch_ray(monkeypatch, *, pending, collected=True, deadline=7.0):
    from ray_train_tpu._compat import ray_train as compat_ray

    monkeypatch.setattr(compat_ray, "in_train_worker", lambda: True)
    monkeypatch.setattr(compat_ray, "preemption_pending", lambda: pending)
    monkeypatch.setattr(compat_ray, "preemption_deadline_s", lambda: deadline)
    monkeypatch.setattr(compat_ray, "wait_for_reports_collected", lambda timeout_s: collected)


def test_stop_parks_the_worker_once_ray_train_knows_of_the_preemption(monkeypatch, caplog):
    """Neither an exception (Ray would charge max_failures) nor a return (the run would
    be finished): the worker waits for Ray's deadline teardown."""
    import threading

    _patch_ray(monkeypatch, pending=True)
    outcome = []

    def stop():
        try:
            preemption.PreemptionGuard(grace_period_s=30).stop()
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)
        outcome.append("returned")

    with caplog.at_level(logging.INFO, logger="ray_train_tpu.checkpoint.preemption"):
        thread = threading.Thread(target=stop, daemon=True)
        thread.start()
        thread.join(1.5)
    assert thread.is_alive() and outcome == []
    assert "waiting for Ray Train to restart the run at the preemption deadline (in 7 s)" in caplog.text


def test_stop_raises_when_ray_train_never_learns_of_the_notice(monkeypatch):
    _patch_ray(monkeypatch, pending=False)
    monkeypatch.setattr(preemption, "_RAY_NOTICE_TIMEOUT_S", 0.3)
    start = time.monotonic()
    with pytest.raises(preemption.Preempted, match=r"never learned.*no drain of the node.*FailureConfig\(max_failures\)"):
        preemption.PreemptionGuard(grace_period_s=30).stop()
    assert 0.3 <= time.monotonic() - start < 5


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

    monkeypatch.setattr(preemption, "_RAY_NOTICE_TIMEOUT_S", 0.1)  # Ray never tells this fake worker
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
