"""`TrainingProgress`: follow a Ray Train run's reports on the driver, with a progress bar.

Ray Train calls a ``ray.train.UserCallback``'s ``after_report`` in its controller
(an actor, not the driver) once every worker has called ``ray.train.report``,
with or without a checkpoint. `TrainingProgress` is such a callback: it forwards
rank 0's metrics of each report to a small actor (no CPU), and while ``fit()``
runs, a driver thread polls that actor, advances a ``tqdm.auto`` bar (a widget
in Jupyter) to the reported ``step`` and keeps every report in ``history``, e.g.
for a loss curve. The training function needs nothing but ``ray.train.report``.

Each report also carries the chips' memory, without any code in the training
function: a companion callback (`WorkerMemory`, which `TrainingProgress.fit`
adds to the run) runs in every worker around each ``ray.train.report`` and sends
`ray_train_tpu.device.accelerator_memory` (``torch.accelerator``'s statistics: HBM
on a TPU, the bytes of live device tensors on a simulated slice) to the same
actor. Every record then has ``device_peak_bytes`` and ``device_allocated_bytes``
(the largest over the ranks), ``device_total_bytes`` (HBM per device) and
``device_memory`` (each rank's), and the bar shows ``mem=<peak>/<HBM>``.

Example:
    >>> progress = TrainingProgress(total=100, desc="fine-tuning")            # doctest: +SKIP
    >>> trainer = TPUTorchTrainer(train_fn, scaling_config=...,               # doctest: +SKIP
    ...     run_config=ray.train.RunConfig(callbacks=[progress]))
    >>> result = progress.fit(trainer)                                        # doctest: +SKIP
    >>> [m["loss"] for m in progress.history][:2]                             # doctest: +SKIP
    [0.69, 0.66]
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional, Sequence

import ray
from ray.train import UserCallback

from ray_train_tpu._compat.ray_train import WorkerReportCallback


class ReportLog:
    """Reports in arrival order; what the progress actor holds (plain, so testable)."""

    def __init__(self):
        self._records: list[dict] = []
        self._memory: dict[int, dict] = {}  # rank -> its chip's memory at its latest report

    def memory(self, rank: int, stats: dict) -> None:
        self._memory[rank] = dict(stats)

    def append(self, metrics: dict, has_checkpoint: bool) -> None:
        self._records.append({**metrics, "checkpoint": has_checkpoint, **memory_summary(self._memory)})

    def since(self, start: int) -> list[dict]:
        return self._records[start:]


class TrainingProgress(UserCallback):
    """A driver-side progress bar and metric history for ``trainer.fit()``.

    Create it on the driver once Ray is initialized (one per ``fit``), pass it in
    ``RunConfig(callbacks=[...])``, and call `fit` instead of ``trainer.fit()``.

    Args:
        total: steps expected, for the bar's length (None: a counter).
        desc: the bar's label.
        step_key: the metric that holds the step; reports without it count one step each.
        postfix: metrics shown next to the bar, e.g. ``("loss",)``.
        poll_s: how often the driver asks for new reports.

    Attributes:
        history: every report so far (rank 0's metrics, plus ``"checkpoint"``:
            whether it carried one, and the chips' memory: ``device_peak_bytes``,
            ``device_allocated_bytes``, ``device_total_bytes``, ``device_memory``),
            in order; restarts after a failure appear as steps counted again.
        worker_callback: the `WorkerMemory` callback that reads each rank's chip
            memory at its reports; `fit` adds it to the run. Calling
            ``trainer.fit()`` yourself, pass both:
            ``RunConfig(callbacks=[progress, progress.worker_callback])``.
    """

    def __init__(self, total: Optional[int] = None, *, desc: str = "training", step_key: str = "step",
                 postfix: Sequence[str] = ("loss",), poll_s: float = 0.5):
        if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 1):
            raise ValueError(f"TrainingProgress(total={total!r}) must be None or an integer >= 1")
        if not poll_s > 0:
            raise ValueError(f"TrainingProgress(poll_s={poll_s!r}) must be > 0")
        self.total, self.desc, self.step_key = total, desc, step_key
        self.postfix, self.poll_s = tuple(postfix), poll_s
        self.history: list[dict] = []
        self._log = ray.remote(num_cpus=0)(ReportLog).remote()
        self.worker_callback = WorkerMemory(self._log)

    def __getstate__(self) -> dict:
        # Ray Train ships the callback to its controller: the actor handle is all it needs.
        return {"_log": self._log}

    # --- in the Ray Train controller

    def after_report(self, run_context, metrics: list, checkpoint) -> None:
        # metrics[i] is worker i's; rank 0's stands for the step, as in result.metrics.
        self._log.append.remote(dict(metrics[0]) if metrics else {}, checkpoint is not None)

    # --- on the driver

    def fit(self, trainer) -> Any:
        """``trainer.fit()`` with the bar following the reports; returns its `Result`.

        ``fit`` itself runs in this (the main) thread, so that Ray Train's own
        Ctrl-C / kernel-interrupt handling stays as it is.
        """
        from tqdm.auto import tqdm

        _add_worker_callback(trainer, self.worker_callback)
        stop = threading.Event()
        with tqdm(total=self.total, desc=self.desc, unit="step") as bar:
            poller = threading.Thread(target=self._follow, args=(bar, stop), daemon=True)
            poller.start()
            try:
                return trainer.fit()
            finally:
                stop.set()
                poller.join()
                self.poll(bar)  # the last reports, after fit() returned

    def _follow(self, bar, stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            self.poll(bar)

    def poll(self, bar=None) -> list[dict]:
        """Fetch the reports not yet in ``history``, append them, move ``bar``; returns them."""
        new = ray.get(self._log.since.remote(len(self.history)))
        if bar is not None and new and not self.history:
            bar.reset(total=self.total)  # the rate counts training steps, not the workers' start-up
        self.history.extend(new)
        if bar is not None and new:
            advance(bar, self.history, self.step_key, self.postfix)
        return new


def _add_worker_callback(trainer, callback: "WorkerMemory") -> None:
    run_config = getattr(trainer, "run_config", None)
    if run_config is None:
        return
    callbacks = list(run_config.callbacks or [])
    if not any(isinstance(c, WorkerMemory) for c in callbacks):
        run_config.callbacks = [*callbacks, callback]


class WorkerMemory(WorkerReportCallback):
    """Runs in every worker (Ray Train copies it there): at each ``ray.train.report``
    it sends this rank's `accelerator_memory` to the progress actor. Nothing is
    sent from a process without an accelerator."""

    def __init__(self, log):
        self._log = log

    @contextlib.contextmanager
    def on_report(self):
        from ray_train_tpu.device import accelerator_memory

        stats = accelerator_memory()
        if stats:
            self._log.memory.remote(ray.train.get_context().get_world_rank(), stats)
        yield


def memory_summary(by_rank: dict) -> dict:
    """The per-rank memory readings as a report's memory fields (none without readings)."""
    if not by_rank:
        return {}
    out = {"device_peak_bytes": max(m.get("peak_bytes", 0) for m in by_rank.values()),
           "device_allocated_bytes": max(m.get("allocated_bytes", 0) for m in by_rank.values()),
           "device_memory": {rank: dict(m) for rank, m in sorted(by_rank.items())}}
    totals = [m["total_bytes"] for m in by_rank.values() if "total_bytes" in m]
    if totals:
        out["device_total_bytes"] = max(totals)
    return out


def format_bytes(n: float) -> str:
    """``1536 -> '1.5KiB'``, ``32 * 2**30 -> '32GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.3g}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def advance(bar, history: Sequence[dict], step_key: str = "step", postfix: Sequence[str] = ()) -> None:
    """Set ``bar`` (a tqdm) to the last report's step (or to the number of reports
    when they carry no ``step_key``) and show its ``postfix`` metrics and the
    chips' peak memory (``mem=peak/HBM``, the largest rank's)."""
    last = history[-1]
    bar.n = int(last[step_key]) if step_key in last else len(history)
    shown = {k: f"{last[k]:.4g}" for k in postfix if isinstance(last.get(k), (int, float))}
    if "device_peak_bytes" in last:
        total = last.get("device_total_bytes")
        shown["mem"] = format_bytes(last["device_peak_bytes"]) + (f"/{format_bytes(total)}" if total else "")
    if shown:
        bar.set_postfix(shown, refresh=False)
    bar.refresh()
