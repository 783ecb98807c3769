"""TrainingProgress: the driver's bar and history follow what the controller's callback forwards.

Ray is replaced by an in-process stand-in (actor calls run at once), so that the
callback, its pickling for the controller, the polling thread and the bar are
tested without a cluster; the notebook test runs it on a simulated slice.
"""

import io
import pickle
import threading
import time

import pytest
from tqdm import tqdm

from ray_train_tpu import progress as progress_mod
from ray_train_tpu.progress import ReportLog, TrainingProgress, advance


class _Method:
    def __init__(self, fn):
        self.remote = fn


_ACTORS: dict = {}  # actor id -> (object, lock)


class _Handle:
    """An actor handle whose calls run in this process, one at a time as an actor's do;
    like a real handle it pickles to a reference to the same actor."""

    def __init__(self, obj):
        self._id = len(_ACTORS)
        _ACTORS[self._id] = (obj, threading.Lock())

    def __getstate__(self):
        return {"_id": self._id}

    def __setstate__(self, state):
        self._id = state["_id"]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        obj, lock = _ACTORS[self._id]

        def call(*args):
            with lock:
                return getattr(obj, name)(*args)

        return _Method(call)


class _FakeRay:
    def remote(self, **options):
        assert options == {"num_cpus": 0}
        return lambda cls: _Method(lambda *a: _Handle(cls(*a)))

    @staticmethod
    def get(value):
        return value


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(progress_mod, "ray", _FakeRay())


@pytest.fixture(autouse=True)
def text_bars(monkeypatch):
    """tqdm.auto in a test is the text bar; write it to a buffer."""
    from tqdm import auto

    out = io.StringIO()
    monkeypatch.setattr(auto, "tqdm", lambda *a, **kw: tqdm(*a, file=out, **kw))
    return out


class _Trainer:
    """fit() reports as Ray Train's controller does: after_report once every worker reported."""

    def __init__(self, callback, steps, fail_at=None):
        self.callback, self.steps, self.fail_at = pickle.loads(pickle.dumps(callback)), steps, fail_at

    def fit(self):
        for step in range(1, self.steps + 1):
            if step == self.fail_at:
                raise RuntimeError("worker died")
            time.sleep(0.01)
            rank0 = {"step": step, "loss": 1.0 / step}
            self.callback.after_report(None, [rank0, {"step": step, "loss": 99.0}], "ckpt" if step % 3 == 0 else None)
        return "result"  # right after the last report: the driver must still fetch it


def test_bar_and_history_follow_the_reports_of_rank_0(fake_ray, text_bars):
    progress = TrainingProgress(total=7, desc="tuning", poll_s=0.02)
    assert progress.fit(_Trainer(progress, steps=7)) == "result"
    assert [m["step"] for m in progress.history] == list(range(1, 8))
    assert [m["loss"] for m in progress.history] == [1.0 / s for s in range(1, 8)]  # rank 0's, not rank 1's
    assert [m["checkpoint"] for m in progress.history] == [s % 3 == 0 for s in range(1, 8)]
    shown = text_bars.getvalue()
    assert "tuning" in shown and "7/7" in shown and "loss=0.1429" in shown


def test_only_the_actor_handle_travels_to_the_controller(fake_ray):
    progress = TrainingProgress(total=3)
    progress.history.append({"step": 1})
    state = progress.__getstate__()
    assert list(state) == ["_log"]


def test_a_failed_fit_raises_and_keeps_what_was_reported(fake_ray):
    progress = TrainingProgress(total=10, poll_s=0.005)
    with pytest.raises(RuntimeError, match="worker died"):
        progress.fit(_Trainer(progress, steps=10, fail_at=5))
    assert [m["step"] for m in progress.history] == [1, 2, 3, 4]


def test_advance_uses_the_step_or_counts_reports():
    bar = tqdm(total=10, file=io.StringIO())
    advance(bar, [{"step": 4, "loss": 0.5, "note": "x"}], postfix=("loss", "note"))
    assert bar.n == 4 and bar.postfix == "loss=0.5"
    advance(bar, [{"loss": 1.0}, {"loss": 0.9}], postfix=("loss",))
    assert bar.n == 2


def test_report_log_returns_what_came_after_an_index():
    log = ReportLog()
    log.append({"step": 1}, False)
    log.append({"step": 2}, True)
    assert log.since(1) == [{"step": 2, "checkpoint": True}]
    assert log.since(2) == []


@pytest.mark.parametrize("kwargs", [{"total": 0}, {"total": 2.5}, {"total": True}, {"poll_s": 0}])
def test_bad_arguments(fake_ray, kwargs):
    with pytest.raises(ValueError, match="TrainingProgress"):
        TrainingProgress(**kwargs)


# --- the chips' memory, read in the workers at each report ---------------------------

class _Context:
    def __init__(self, rank):
        self.rank = rank

    def get_world_rank(self):
        return self.rank


def test_each_report_carries_the_chips_memory_read_in_the_workers(fake_ray, text_bars, monkeypatch):
    """The worker callback reads accelerator_memory inside ray.train.report (no code in the
    training function); the next record holds the largest rank's peak and the bar shows it."""
    import types

    from ray_train_tpu import device

    progress = TrainingProgress(total=2, poll_s=0.01)
    worker = pickle.loads(pickle.dumps(progress.worker_callback))  # as Ray Train ships it to a worker
    readings = {0: {"allocated_bytes": 3 * 2**20, "peak_bytes": 5 * 2**20, "total_bytes": 32 * 2**30},
                1: {"allocated_bytes": 4 * 2**20, "peak_bytes": 6 * 2**20, "total_bytes": 32 * 2**30}}
    for rank, stats in readings.items():
        monkeypatch.setattr(device, "accelerator_memory", lambda stats=stats: stats)
        monkeypatch.setattr(progress_mod, "ray", types.SimpleNamespace(
            train=types.SimpleNamespace(get_context=lambda rank=rank: _Context(rank)), get=_FakeRay.get,
            remote=_FakeRay().remote))
        with worker.on_report():
            pass
    trainer = _Trainer(progress, steps=2)
    trainer.run_config = types.SimpleNamespace(callbacks=[progress])
    progress.fit(trainer)
    assert trainer.run_config.callbacks == [progress, progress.worker_callback]  # fit added the worker side
    last = progress.history[-1]
    assert last["device_peak_bytes"] == 6 * 2**20 and last["device_allocated_bytes"] == 4 * 2**20
    assert last["device_total_bytes"] == 32 * 2**30 and last["device_memory"] == readings
    assert "mem=6MiB/32GiB" in text_bars.getvalue()


def test_no_memory_fields_where_no_worker_has_an_accelerator(fake_ray, monkeypatch):
    from ray_train_tpu import device

    progress = TrainingProgress(total=1)
    monkeypatch.setattr(device, "accelerator_memory", lambda: {})
    with progress.worker_callback.on_report():  # sends nothing (no rank needed)
        pass
    progress.fit(_Trainer(progress, steps=1))
    assert set(progress.history[0]) == {"step", "loss", "checkpoint"}


def test_the_worker_callback_is_ray_trains_worker_side_report_hook():
    from ray.train import UserCallback

    from ray_train_tpu._compat.ray_train import WorkerReportCallback
    from ray_train_tpu.progress import WorkerMemory

    # not a UserCallback: Ray Train copies only the other kinds to the workers
    assert issubclass(WorkerMemory, WorkerReportCallback) and not issubclass(WorkerMemory, UserCallback)


def test_format_bytes():
    assert [progress_mod.format_bytes(n) for n in (512, 1536, 16 * 2**20, 32 * 2**30)] == [
        "512B", "1.5KiB", "16MiB", "32GiB"]
