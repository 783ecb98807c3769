"""Ray Train's side: `report` a checkpoint every rank wrote, `restore` the last one."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional

from ray_train_tpu.checkpoint.manifest import CheckpointInfo
from ray_train_tpu.checkpoint.reader import load
from ray_train_tpu.checkpoint.writer import save

def report(metrics: dict, *, model, optimizer=None, lr_scheduler=None, dataloader=None, step: int,
           extra: Optional[dict] = None, async_save: bool = False) -> None:
    """`save` into a fresh local directory on every rank and hand it to
    ``ray.train.report``, which merges all ranks' files into one checkpoint in
    the run's storage. Call it on every rank, every time. With ``async_save``
    the ``ray.train.report`` of this step happens once its files are complete:
    at the next `report`, `save` or `wait` (call `wait` after the last step).

    Example:
        >>> checkpoint.report({"loss": loss}, model=model, optimizer=opt,  # doctest: +SKIP
        ...                   dataloader=loader, step=step)
    """
    import ray.train

    directory = Path(tempfile.mkdtemp(prefix="ray_train_tpu_ckpt_"))

    def hand_over(info: CheckpointInfo) -> None:
        try:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(directory)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    pending = save(directory, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                   dataloader=dataloader, step=step, extra=extra, async_save=async_save)
    if async_save:
        pending.then(hand_over)
    else:
        hand_over(pending)


def restore(*, model, optimizer=None, lr_scheduler=None, dataloader=None, rng: bool = True) -> Optional[CheckpointInfo]:
    """Load ``ray.train.get_checkpoint()`` (the last checkpoint Ray Train
    registered, i.e. one every rank reported) if there is one; None otherwise.

    Example:
        >>> info = checkpoint.restore(model=model, optimizer=opt, dataloader=loader)  # doctest: +SKIP
    """
    import ray.train

    if (ckpt := ray.train.get_checkpoint()) is None:
        return None
    with ckpt.as_directory() as directory:
        return load(directory, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                    dataloader=dataloader, rng=rng)
