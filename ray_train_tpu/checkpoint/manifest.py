"""What a complete checkpoint is: its files, its manifest (written last), and how it is verified."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import zlib
from pathlib import Path
from typing import Optional

logger = logging.getLogger("ray_train_tpu.checkpoint")

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


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


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
