"""The worker functions' old path, kept for `ray_train_tpu.serve` (which reads
reports as dicts): everything else uses `ray_train_tpu._worker_fns`."""

from __future__ import annotations

from ray_train_tpu import _worker_fns
from ray_train_tpu._worker_fns import apply_env, free_port  # noqa: F401  (re-exported)

__all__ = ["apply_env", "free_port", "report"]


def report() -> dict:
    """`_worker_fns.report` as a dict (``worker_id``, ``simulate``, ...)."""
    return _worker_fns.report().as_dict()
