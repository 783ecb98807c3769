"""`save` (synchronous or in the background), `AsyncSave` and `wait`."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Optional

from ray_train_tpu.checkpoint._collective import _all_gather, _async_group, _barrier, _broadcast, _rank_world
from ray_train_tpu.checkpoint.manifest import (
    _RANK_FILE,
    FORMAT,
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    _digest,
    _file_entry,
    _fingerprint,
    _state_dicts,
    _write_manifest,
)

def _rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    accelerator = _accelerator_rng_module()
    if accelerator is not None:  # a TPU's generator is its own: dropout on the device draws from it
        state["accelerator"] = (accelerator[0], accelerator[1].get_rng_state())
    if "numpy" in sys.modules:  # as plain lists: loadable with weights_only=True
        name, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    return state


def _accelerator_rng_module():
    """``(device type, torch.<device> module)`` of this process's accelerator other
    than CUDA (kept under "cuda" as before) when it has its own generator and has
    started in this process, else None. Never starts it: on a TPU host a process
    that only imported torch_tpu (a driver saving or reading a checkpoint) would
    otherwise open the chips and hold libtpu's lockfile against the workers."""
    import torch

    current = torch.accelerator.current_accelerator()
    if current is None or current.type in ("cpu", "cuda"):
        return None
    module = torch.get_device_module(current.type)
    if not all(hasattr(module, f) for f in ("get_rng_state", "set_rng_state", "is_initialized")):
        return None
    return (current.type, module) if module.is_initialized() else None


def _write_rank_file(directory: Path, rank: int, world_size: int, dataloader) -> tuple[str, dict]:
    import torch

    name = _RANK_FILE.format(rank)
    payload = {"rank": rank, "world_size": world_size, "rng": _rng_state(),
               "dataloader": None if dataloader is None else dataloader.state_dict()}
    torch.save(payload, directory / f".{name}.tmp")
    os.replace(directory / f".{name}.tmp", directory / name)  # never a half-written file under its name
    return name, _file_entry(directory / name)


def save(directory, *, model, optimizer=None, lr_scheduler=None, dataloader=None, step: int,
         extra: Optional[dict] = None, async_save: bool = False):
    """Save every rank's part of a checkpoint into ``directory`` (call on every rank).

    ``directory`` is one shared directory, or one per rank merged afterwards (as
    `report` has Ray Train do); it must not hold a complete checkpoint already.
    ``model`` is the module as trained (DDP, FSDP2, TP or plain); ``dataloader`` a
    `ray_train_tpu.data.stateful_dataloader`; ``extra`` a JSON-serialisable dict.
    With ``async_save`` DCP writes in the background (on a gloo group of its own)
    and an `AsyncSave` is returned: the checkpoint is complete when its
    ``result()`` returned on every rank, which the next `save` or `wait` does first.
    Returns a `CheckpointInfo` (or the `AsyncSave`).

    Example:
        >>> save("/ckpt/step_10", model=model, optimizer=opt, dataloader=loader,  # doctest: +SKIP
        ...      step=10, extra={"epoch": 1})
    """
    wait()
    _check_save_args(step, extra)
    directory, (rank, world_size) = Path(directory), _rank_world()
    if _broadcast((directory / MANIFEST).exists() if rank == 0 else None):
        raise CheckpointError(f"{directory / MANIFEST} exists: {directory} already holds a complete checkpoint, "
                              "and save never overwrites one; save each step to a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = _dcp_state(model_sd, optim_sd, lr_scheduler)
    rank_files = dict(_all_gather(_write_rank_file(directory, rank, world_size, dataloader)))
    manifest = {
        "format": FORMAT, "step": step, "world_size": world_size, "extra": extra or {},
        "components": sorted([*state, "rng"] + (["dataloader"] if dataloader is not None else [])),
        "optimizer": _optimizer_summary(optimizer), "model": _fingerprint(model_sd),
    }
    manifest["fingerprint"] = _digest(manifest["model"])
    pending = AsyncSave(directory, manifest, rank_files, _start_dcp_save(state, directory, async_save))
    return pending if async_save else pending.result()


def _dcp_state(model_sd: dict, optim_sd: Optional[dict], lr_scheduler) -> dict:
    sched_sd = None if lr_scheduler is None else lr_scheduler.state_dict()
    state = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": sched_sd}
    return {k: v for k, v in state.items() if v is not None}


def _check_save_args(step, extra) -> None:
    from ray_train_tpu import _validate as V

    V.check_int("save", "step", step, min=0, fix="pass the training step, e.g. step=100")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save(extra=...) must be a JSON-serialisable dict ({e}); keep tensors in the model") from e
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save(extra={extra!r}) must be a dict")


def _optimizer_summary(opt) -> Optional[dict]:
    return None if opt is None else {"class": type(opt).__name__, "param_groups": len(opt.param_groups)}


def _start_dcp_save(state: dict, directory: Path, async_save: bool):
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(directory))
    if not async_save:
        return dcp.save(state, storage_writer=writer)
    response = dcp.async_save(state, storage_writer=writer, process_group=_async_group())
    return getattr(response, "upload_completion", response)


_PENDING: list = []


class AsyncSave:
    """A save under way. ``result()`` waits for it; rank 0 then writes the manifest and all
    ranks meet in a barrier, so call it on every rank (`save`, `report` and `wait` do)."""

    def __init__(self, directory: Path, manifest: dict, rank_files: dict, metadata_or_future):
        self.directory, self._manifest, self._rank_files = directory, manifest, rank_files
        self._future, self._info, self._then = metadata_or_future, None, []
        if hasattr(metadata_or_future, "result"):
            _PENDING.append(self)

    def then(self, fn) -> None:
        """Run ``fn(info)`` on this rank once the checkpoint is complete."""
        self._then.append(fn)

    def result(self) -> CheckpointInfo:
        if self._info is None:
            metadata = self._future.result() if hasattr(self._future, "result") else self._future
            if self in _PENDING:
                _PENDING.remove(self)
            if _rank_world()[0] == 0:
                _write_manifest(self.directory, self._manifest, metadata, self._rank_files)
            _barrier()
            m = self._manifest
            self._info = CheckpointInfo(m["step"], m["extra"], str(self.directory), m["world_size"])
            for fn in self._then:
                fn(self._info)
        return self._info


def wait() -> Optional[CheckpointInfo]:
    """Finish this process's background save, if any (call on every rank).

    Example:
        >>> save(d, model=model, step=3, async_save=True); wait().step  # doctest: +SKIP
        3
    """
    info = None
    while _PENDING:
        info = _PENDING[0].result()
    return info
