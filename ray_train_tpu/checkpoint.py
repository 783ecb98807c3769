"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

`save` writes model, optimizer, LR scheduler, and each rank's data-loader
position and RNG state; `load` puts them back. Model and optimizer go through
``get_state_dict``/``set_state_dict``: saved sharded as the strategy holds them
(DDP, FSDP2, DTensor TP, 2-D), never gathered on one rank, and resharded on load
(a DDP checkpoint loads into FSDP2, a 2-rank one into one process).

A checkpoint is complete or absent: rank 0 writes ``manifest.json`` last (step,
world size, a strategy-independent fingerprint of tensor names/shapes/dtypes,
every file and its size). `load` verifies it all before changing anything and
raises `CheckpointError` (a ValueError) or `CheckpointNotFoundError` (also a
FileNotFoundError) naming the file and the mismatch; it never writes.

Files (names unique per writer, so that Ray Train can merge `report`'s per-rank
directories): ``__<rank>_<n>.distcp`` (DCP shards), ``.metadata`` (rank 0),
``rank<rank:05d>.pt`` (data-loader and RNG state), ``manifest.json`` (rank 0).

Bitwise-exact resume also needs the same world size and strategy, a loader that
never draws from the global RNG (`ray_train_tpu.data.stateful_dataloader`) and,
for DDP with more than 2 ranks, ``find_unused_parameters=True``: DDP rebuilds its
gradient buckets after its first iteration, so a restarted DDP sums its first
step's gradients in another order (last-bit differences).

Example:
    >>> from ray_train_tpu import checkpoint
    >>> checkpoint.save(f"/ckpt/step_{step}", model=model, optimizer=opt, step=step)  # doctest: +SKIP
    >>> checkpoint.load(f"/ckpt/step_{step}", model=model, optimizer=opt).step        # doctest: +SKIP
    100
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "ray_train_tpu.checkpoint/1"
_DCP_METADATA = ".metadata"
_RANK_FILE = "rank{:05d}.pt"  # per-rank data-loader and RNG state


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, corrupt, or of another model."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, or a file it lists, is missing."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint's ``step``, ``extra`` (your dict), ``path``, and the ``world_size`` that wrote it."""

    step: int
    extra: dict
    path: str
    world_size: int


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _barrier() -> None:
    if _dist():
        _dist().barrier()


def _broadcast(obj):
    box = [obj]
    if _dist():
        _dist().broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    out = [obj] * _rank_world()[1]
    if _dist():
        _dist().all_gather_object(out, obj)
    return out


_ASYNC_GROUP: dict = {}


def _async_group():
    """A gloo group for background saves only: no collective interleaves with training's."""
    dist = _dist()
    if dist and id(dist.group.WORLD) not in _ASYNC_GROUP:
        _ASYNC_GROUP.clear()
        _ASYNC_GROUP[id(dist.group.WORLD)] = dist.new_group(backend="gloo")
    return _ASYNC_GROUP[id(dist.group.WORLD)] if dist else None


def _state_dicts(model, optimizer) -> tuple[dict, Optional[dict]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    return (get_model_state_dict(model), None) if optimizer is None else get_state_dict(model, optimizer)


def fingerprint(model) -> list:
    """``[name, global shape, dtype]`` of every tensor in ``model``'s state dict,
    sorted; the same under DDP, FSDP2, TP or no wrapper at all.

    Example:
        >>> import torch
        >>> fingerprint(torch.nn.Linear(2, 3))
        [['bias', [3], 'torch.float32'], ['weight', [3, 2], 'torch.float32']]
    """
    return _fingerprint(_state_dicts(model, None)[0])


def _fingerprint(model_sd: dict) -> list:
    import torch

    return sorted([k, list(v.shape), str(v.dtype)] for k, v in model_sd.items() if isinstance(v, torch.Tensor))


def _digest(entries: list) -> str:
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # as plain lists: loadable with weights_only=True
        name, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


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


def _write_manifest(directory: Path, manifest: dict, metadata, rank_files: dict) -> None:
    files: dict = {}
    for item in metadata.storage_data.values():  # DCP shards: the bytes DCP will read
        end = max(item.offset + item.length, files.get(item.relative_path, {}).get("size", 0))
        files[item.relative_path] = {"size": end}
    files[_DCP_METADATA] = _file_entry(directory / _DCP_METADATA)
    files.update(rank_files)
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({**manifest, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def verify(directory) -> dict:
    """Check that ``directory`` holds a complete checkpoint and return its manifest:
    `CheckpointNotFoundError` for no manifest (an unfinished save) or a missing
    file, `CheckpointError` for a bad manifest or a truncated or corrupt file.

    Example:
        >>> verify("/ckpt/step_10")["step"]  # doctest: +SKIP
        10
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} not found: {directory} is not a complete ray_train_tpu checkpoint "
                                      "(a save that did not finish writes no manifest); load an earlier one")
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r} is not {FORMAT!r}")
        files, step = manifest["files"], manifest["step"]
    except (ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid manifest ({e}); the checkpoint is corrupt") from e
    for name, want in files.items():
        _verify_file(path.parent / name, want, step)
    return manifest


def _verify_file(path: Path, want: dict, step) -> None:
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path} (listed in the manifest of step {step}) is missing")
    size = path.stat().st_size
    if size < want["size"] or ("crc32" in want and size != want["size"]):
        raise CheckpointError(f"{path} has {size} bytes, the manifest of step {step} says {want['size']}: "
                              "the file is truncated or was overwritten; load an earlier checkpoint")
    crc = _crc32(path) if "crc32" in want else None
    if crc != want.get("crc32"):
        raise CheckpointError(f"{path} has crc32 {crc}, the manifest of step {step} says {want['crc32']}: "
                              "the file is corrupt; load an earlier checkpoint")


def load(directory, *, model, optimizer=None, lr_scheduler=None, dataloader=None, rng: bool = True) -> CheckpointInfo:
    """Verify a checkpoint, then load it into the given objects (call on every rank).

    Model and optimizer may be wrapped and sharded otherwise than when saved
    (DCP reshards). Data-loader position and RNG state are per rank: with another
    world size, ``dataloader`` raises and the RNG is left as it is (a warning).
    Raises what `verify` raises, and `CheckpointError` when the model's
    fingerprint, the optimizer or a requested component does not match.

    Example:
        >>> start = load("/ckpt/step_10", model=model, optimizer=opt, dataloader=loader).step + 1  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    directory, (rank, world_size) = Path(directory), _rank_world()
    manifest = verify(directory)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    _check_compatible(directory, manifest, model_sd, optimizer, lr_scheduler, dataloader, world_size)
    state = _dcp_state(model_sd, optim_sd, lr_scheduler)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)))
    except Exception as e:  # DCP wraps every rank's error in a CheckpointException
        raise CheckpointError(f"{directory}: DCP could not load {sorted(state)} ({e})") from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    _load_rank_file(directory, manifest, rank, world_size, dataloader, rng)
    return CheckpointInfo(manifest["step"], manifest["extra"], str(directory), manifest["world_size"])


def _check_compatible(directory, manifest, model_sd, optimizer, lr_scheduler, dataloader, world_size) -> None:
    ours = _fingerprint(model_sd)
    if _digest(ours) != manifest.get("fingerprint") or ours != manifest.get("model"):
        diff = _model_diff(manifest.get("model") or [], ours)
        raise CheckpointError(f"{directory / MANIFEST} was written for another model: {diff}; "
                              "load it into the model it was saved from")
    for name, given in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler), ("dataloader", dataloader)):
        if given is not None and name not in manifest["components"]:
            raise CheckpointError(f"{directory} has no {name} state (it holds {manifest['components']}); "
                                  f"pass {name}=None")
    saved, now = manifest.get("optimizer"), _optimizer_summary(optimizer)
    if now is not None and saved != now:
        raise CheckpointError(f"{directory} holds the state of optimizer {saved}, not of {now}; use the same optimizer "
                              "class and parameter groups, or pass optimizer=None and start it afresh")
    if dataloader is not None and manifest["world_size"] != world_size:
        raise CheckpointError(
            f"{directory} holds the data-loader positions of world_size={manifest['world_size']}, this run has "
            f"world_size={world_size}; a rank's position means nothing in another sharding: pass dataloader=None "
            "and restart the epoch with loader.set_epoch(...)")


def _model_diff(saved: list, ours: list) -> str:
    a, b = {e[0]: e[1:] for e in saved}, {e[0]: e[1:] for e in ours}
    out = [f"{k!r} is in the checkpoint but not in the model" for k in sorted(set(a) - set(b))]
    out += [f"{k!r} is in the model but not in the checkpoint" for k in sorted(set(b) - set(a))]
    out += [f"{k!r} is {a[k][0]} {a[k][1]} in the checkpoint and {b[k][0]} {b[k][1]} in the model"
            for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    more = f" (and {len(out) - 3} more)" if len(out) > 3 else ""
    return "; ".join(out[:3]) + more if out else "the manifest's fingerprint does not match"


def _load_rank_file(directory: Path, manifest: dict, rank: int, world_size: int, dataloader, rng: bool) -> None:
    import torch

    if manifest["world_size"] != world_size:
        if rng:  # the per-rank streams of another world size map to no rank here
            logger.warning("ray_train_tpu.checkpoint: RNG state not restored: %s was saved by world_size=%d, this "
                           "run has %d", directory, manifest["world_size"], world_size)
        return
    payload = torch.load(directory / _RANK_FILE.format(rank), weights_only=True)
    if dataloader is not None:
        dataloader.load_state_dict(payload["dataloader"])
    if rng:
        _set_rng_state(payload["rng"])


def latest_checkpoint(root) -> Optional[Path]:
    """The complete checkpoint with the highest step among ``root``'s subdirectories (or
    None); incomplete or corrupt ones are skipped with a warning naming them.

    Example:
        >>> latest_checkpoint("/ckpt")  # doctest: +SKIP
        PosixPath('/ckpt/step_10')
    """
    found = []
    for sub in sorted(p for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []:
        try:
            found.append((verify(sub)["step"], sub))
        except CheckpointError as e:
            logger.warning("ray_train_tpu.checkpoint: skipping %s: %s", sub, e)
    return max(found)[1] if found else None


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

