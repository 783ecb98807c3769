"""`export_hf`: a checkpoint of ours -> a Hugging Face model directory.

The directory holds the checkpoint's model weights as safetensors (written by
torch.distributed.checkpoint's own ``HuggingFaceStorageWriter``), with a
``model.safetensors.index.json``, and the base model's config, generation
config and tokenizer files: what transformers' ``from_pretrained``, vLLM, Ray
Serve LLM, `ray_train_tpu.serve` and the GRPO trainer (`ray_train_tpu.rl`) load.

It works from the checkpoint as saved, by any strategy and world size (DDP,
FSDP2, TP, FSDP2+TP, HSDP; our trainer's and GRPO's trainer's checkpoints are
the same format), and never gathers the model in one process: the output is cut
into files of at most ``max_file_bytes`` (one tensor may exceed it), and a
process reads, with DCP's resharding reader, only the tensors of the file it
writes, one file at a time. Peak host memory grows by about three times the
largest file (its tensors, and the bytes DCP's writer serializes them into).
Called on every rank of a process group (e.g. inside Ray Train workers), the
files are shared out among the ranks; called in one process (the CLI), that
process writes them all, one after another.

Refused with `ExportError` (a ValueError), before anything is written: an
incomplete or corrupt checkpoint (no manifest, a missing or truncated file), a
base model whose tensor names or shapes differ from the checkpoint's, an
existing non-empty destination without ``overwrite=True``, a destination that
holds the checkpoint or the base model.

``dest`` is a local path or a URI (``gs://``, ``s3://``, ``file://``...), as
Ray Train's ``RunConfig(storage_path=...)``, resolved by pyarrow; or pass a
``pyarrow.fs.FileSystem`` as ``filesystem`` with ``dest`` a path on it
(``RunConfig.storage_filesystem``). For a URI, each file is staged on local
disk, uploaded, and removed before the next.

Example:
    >>> from ray_train_tpu.checkpoint import export_hf
    >>> info = export_hf("/ckpt/step_100", "/models/SmolLM2-135M-Instruct",  # doctest: +SKIP
    ...                  "gs://bucket/models/smollm2-ft")
    >>> info.files                                                             # doctest: +SKIP
    ('model-00001-of-00001.safetensors',)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

from ray_train_tpu.checkpoint._collective import _all_gather, _broadcast, _rank_world
from ray_train_tpu.checkpoint._hf_names import hf_names
from ray_train_tpu.checkpoint.manifest import CheckpointError, verify

logger = logging.getLogger("ray_train_tpu.checkpoint")

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_FILE_BYTES = 1 << 30
_MODEL_KEY = "model."  # the model's part of our DCP checkpoint (see writer._dcp_state)
# Base-model files that are weights (ours replace them) or not part of a model directory.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$")


class ExportError(ValueError):
    """An export refused: the checkpoint, the base model or the destination is not usable."""


@dataclasses.dataclass(frozen=True)
class ExportInfo:
    """What `export_hf` wrote: ``dest``, the checkpoint's ``step`` and ``world_size``,
    the weight ``files``, ``num_tensors``, ``num_bytes`` of weights, their ``dtype``,
    how many processes wrote them (``export_world_size``) and the ``seconds`` it took."""

    dest: str
    step: int
    world_size: int
    files: tuple
    num_tensors: int
    num_bytes: int
    dtype: str
    export_world_size: int
    seconds: float


def export_hf(checkpoint, base_model_dir, dest, overwrite: bool = False, *, filesystem=None,
              dtype=None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ExportInfo:
    """Export the model of a complete checkpoint as a Hugging Face directory at ``dest``.

    ``checkpoint``: a checkpoint directory (ours, e.g. from `save` or `report`;
    a ``ray.train.Checkpoint`` on a local or mounted path works too).
    ``base_model_dir``: the local Hugging Face directory the run started from
    (safetensors weights, ``config.json``, tokenizer): names, shapes, config and
    tokenizer come from it, weights never. ``dtype`` (e.g. ``"bfloat16"``) casts
    the weights, one tensor at a time; by default they keep the checkpoint's
    dtype, and the exported ``config.json`` states the dtype written.

    Call it in one process, or on every rank of a process group to share the
    files out. Returns an `ExportInfo` (on every rank).

    Example:
        >>> export_hf("/ckpt/step_100", "/models/base", "/models/finetuned").num_tensors  # doctest: +SKIP
        273
    """
    start = time.perf_counter()
    rank, world = _rank_world()
    plan = _agree(lambda: _plan(checkpoint, base_model_dir, dest, overwrite, filesystem, dtype, max_file_bytes),
                  rank)
    written = _agree_all(lambda: _write_files(plan, rank, world))
    _agree(lambda: _finish(plan, [f for part in written for f in part]), rank)  # no rank waits on a failed one
    files = tuple(sorted(f[0] for part in written for f in part))
    return ExportInfo(dest=str(dest), step=plan["step"], world_size=plan["world_size"], files=files,
                      num_tensors=len(plan["fqn_to_index"]), num_bytes=plan["num_bytes"], dtype=plan["dtype"],
                      export_world_size=world, seconds=time.perf_counter() - start)


def _agree(fn, rank: int):
    """``fn()`` on rank 0, its result (or its error) on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:
            error = e
    shared = _broadcast(("error", f"{error}") if error is not None else ("ok", result))
    if error is not None:
        raise error
    if shared[0] == "error":
        raise ExportError(shared[1])
    return shared[1]


def _agree_all(fn) -> list:
    """``fn()`` on every rank; every rank's result, or every rank raises the first error."""
    error = None
    try:
        mine = ("ok", fn())
    except Exception as e:
        error, mine = e, ("error", f"{type(e).__name__}: {e}")
    every = _all_gather(mine)
    failed = [f"rank {r}: {m[1]}" for r, m in enumerate(every) if m[0] == "error"]
    if failed:
        raise RuntimeError("export failed: " + "; ".join(failed)) from error
    return [m[1] for m in every]


# ------------------------------------------------------------------ plan (rank 0, read-only until checked)


def _plan(checkpoint, base_model_dir, dest, overwrite, filesystem, dtype, max_file_bytes) -> dict:
    from ray_train_tpu import _validate as V

    V.check_bool("export_hf", "overwrite", overwrite)
    V.check_int("export_hf", "max_file_bytes", max_file_bytes, min=1, fix="e.g. max_file_bytes=1 << 30")
    ckpt = _checkpoint_dir(checkpoint)
    try:
        manifest = verify(ckpt)
    except CheckpointError as e:
        raise ExportError(f"checkpoint {ckpt} cannot be exported: {e}") from e
    ours = _checkpoint_tensors(ckpt)
    base_dir = Path(base_model_dir)
    base, config = _base_model(base_dir)
    try:
        mapping = hf_names({k: v[0] for k, v in ours.items()}, base,
                           tied=bool(config.get("tie_word_embeddings", True)))
    except ValueError as e:
        raise ExportError(f"checkpoint {ckpt} is not of the base model {base_dir}: {e}; pass the Hugging Face "
                          "directory the run started from as the base model") from e
    out_dtype = _dtype(dtype, {v[1] for v in ours.values()})
    files = _group(mapping, ours, out_dtype, max_file_bytes)
    fs, path = _destination(dest, filesystem, [ckpt, base_dir], overwrite)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "world_size": manifest["world_size"],
            "base": str(base_dir), "config": config, "fs": fs, "path": path, "dtype": out_dtype,
            "files": files, "fqn_to_index": {hf: i for i, group in enumerate(files, 1) for _, hf, _, _ in group},
            "num_bytes": sum(_nbytes(shape, out_dtype) for group in files for _, _, shape, _ in group)}


def _checkpoint_dir(checkpoint) -> Path:
    if hasattr(checkpoint, "filesystem") and hasattr(checkpoint, "path"):  # a ray.train.Checkpoint
        import pyarrow.fs

        if not isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
            raise ExportError(f"checkpoint {checkpoint} is on {type(checkpoint.filesystem).__name__}: export reads "
                              "a local or mounted path; mount the storage (e.g. gcsfuse) or download it first")
        return Path(checkpoint.path)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"export_hf(checkpoint={checkpoint!r}) must be a path or a ray.train.Checkpoint")
    return Path(checkpoint)


def _checkpoint_tensors(ckpt: Path) -> dict:
    """``{model tensor name: (global shape, dtype)}`` from DCP's metadata: what will be read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    ours = {k[len(_MODEL_KEY):]: (tuple(md.size), md.properties.dtype) for k, md in metadata.items()
            if k.startswith(_MODEL_KEY) and isinstance(md, TensorStorageMetadata)}
    if not ours:
        raise ExportError(f"checkpoint {ckpt} holds no model tensors (it has {sorted(metadata)[:5]})")
    return ours


def _safetensors_shapes(path: Path) -> dict:
    """``{name: shape}`` from a safetensors file's header alone: 8 bytes of length, then JSON.
    (``safe_open`` maps the whole file, and the pages it touches count in this process's RSS.)"""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def _base_model(base_dir: Path) -> tuple[dict, dict]:
    """The base model's ``{tensor name: shape}`` (safetensors headers only) and its config."""
    if not (base_dir / "config.json").is_file():
        raise ExportError(f"base model {base_dir} has no config.json: pass a local Hugging Face model directory "
                          "(e.g. from huggingface_hub.snapshot_download or save_pretrained)")
    weights = sorted(base_dir.glob("*.safetensors"))
    if not weights:
        raise ExportError(f"base model {base_dir} has no *.safetensors files (names and shapes are read from "
                          "them); re-save it with save_pretrained(safe_serialization=True)")
    base = {}
    for path in weights:
        try:
            base.update(_safetensors_shapes(path))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise ExportError(f"base model file {path} is not a readable safetensors file ({e})") from e
    return base, json.loads((base_dir / "config.json").read_text())


def _dtype(dtype, saved: set) -> str:
    import torch

    if dtype is None:
        if len(saved) != 1:
            raise ExportError(f"the checkpoint's model tensors have dtypes {sorted(map(str, saved))}: pass one "
                              "dtype to export them in, e.g. dtype='bfloat16'")
        return str(next(iter(saved))).removeprefix("torch.")
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        raise ValueError(f"export_hf(dtype={dtype!r}) must be a floating-point torch dtype, e.g. 'bfloat16'")
    return name


def _nbytes(shape, dtype: str) -> int:
    import math

    import torch

    return math.prod(shape) * getattr(torch, dtype).itemsize


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _group(mapping: dict, ours: dict, dtype: str, max_file_bytes: int) -> list:
    """Files in order, each ``[(our name, HF name, shape, checkpoint dtype)]`` of at most
    ``max_file_bytes`` (a bigger tensor gets a file of its own)."""
    files, size = [[]], 0
    for name, hf in sorted(mapping.items(), key=lambda kv: _natural(kv[1])):
        shape, saved = ours[name]
        n = _nbytes(shape, dtype)
        if files[-1] and size + n > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append((name, hf, shape, str(saved).removeprefix("torch.")))
        size += n
    return files


def _destination(dest, filesystem, sources: list, overwrite: bool):
    """``(pyarrow filesystem or None for local, path)``, checked empty (or emptied with ``overwrite``)."""
    if not isinstance(dest, (str, os.PathLike)):
        raise TypeError(f"export_hf(dest={dest!r}) must be a path or URI")
    fs, path = _resolve(str(dest), filesystem)
    if fs is None:
        target = Path(path).resolve()
        for src in sources:
            if target == src.resolve() or target in src.resolve().parents:
                raise ExportError(f"destination {dest} holds {src}: export into a directory of its own")
        if target.exists() and not target.is_dir():
            raise ExportError(f"destination {dest} is a file: pass a directory")
        present = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    else:
        import pyarrow.fs

        info = fs.get_file_info(path)
        if info.type == pyarrow.fs.FileType.File:
            raise ExportError(f"destination {dest} is a file: pass a directory")
        selector = pyarrow.fs.FileSelector(path, allow_not_found=True)
        present = sorted(Path(i.path).name for i in fs.get_file_info(selector))
    if present and not overwrite:
        raise ExportError(f"destination {dest} is not empty ({len(present)} entries, e.g. {present[0]!r}): pass "
                          "overwrite=True (--overwrite) to replace its contents, or export into an empty directory")
    if present:
        logger.warning("ray_train_tpu: export replaces the %d entries of %s (overwrite=True)", len(present), dest)
        if fs is None:
            for name in present:
                p = Path(path) / name
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            fs.delete_dir_contents(path, missing_dir_ok=True)
    if fs is None:
        Path(path).mkdir(parents=True, exist_ok=True)
    else:
        fs.create_dir(path, recursive=True)
    return fs, path


def _resolve(dest: str, filesystem):
    """As Ray Train's storage path: a given filesystem, else pyarrow's from a URI; local as ``None``."""
    if filesystem is None and "://" not in dest:
        return None, dest
    import pyarrow.fs

    fs, path = (filesystem, dest) if filesystem is not None else pyarrow.fs.FileSystem.from_uri(dest)
    return (None, path) if isinstance(fs, pyarrow.fs.LocalFileSystem) else (fs, path)


# ------------------------------------------------------------------ writing (every rank, its own files)


def _write_files(plan: dict, rank: int, world: int) -> list:
    """This rank's files (file index % world == rank): ``[(file name, [HF names])]``."""
    mine = [(i, group) for i, group in enumerate(plan["files"], 1) if (i - 1) % world == rank]
    if not mine:
        return []
    local = plan["fs"] is None
    staging = Path(tempfile.mkdtemp(prefix=f".export-rank{rank:05d}-", dir=plan["path"] if local else None))
    try:
        return [_write_file(plan, index, group, staging) for index, group in mine]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_file(plan: dict, index: int, group: list, staging: Path) -> tuple:
    """Read one file's tensors (whole, from every rank's shards) and write them with DCP's HF writer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = {"model": {name: torch.empty(shape, dtype=getattr(torch, saved)) for name, _, shape, saved in group}}
    part = staging / f"file{index}"
    with warnings.catch_warnings():  # no_dist is meant: each process reads and writes whole tensors of its own
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(plan["checkpoint"]), no_dist=True)
        out_dtype = getattr(torch, plan["dtype"])
        tensors = {hf: state["model"].pop(name).to(out_dtype) for name, hf, _, _ in group}
        dcp.save(tensors, no_dist=True,
                 storage_writer=HuggingFaceStorageWriter(str(part), fqn_to_index_mapping=plan["fqn_to_index"]))
    del tensors
    (written,) = [p for p in part.iterdir() if p.suffix == ".safetensors"]
    _publish(plan, written, written.name)
    return written.name, [hf for _, hf, _, _ in group]


def _publish(plan: dict, local_file: Path, name: str) -> None:
    """Move (local) or upload (URI) a finished file into the destination under ``name``."""
    if plan["fs"] is None:
        os.replace(local_file, Path(plan["path"]) / name)
        return
    with open(local_file, "rb") as src, plan["fs"].open_output_stream(f"{plan['path'].rstrip('/')}/{name}") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
    local_file.unlink()


def _finish(plan: dict, written: list) -> None:
    """Rank 0, after every weight file: the index, the base model's other files, config.json last."""
    weight_map = {hf: name for name, names in written for hf in names}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": plan["num_bytes"]},
                                             "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        _publish(plan, tmp / INDEX, INDEX)
        base = Path(plan["base"])
        for src in sorted(base.iterdir()):
            if src.is_file() and src.name != "config.json" and not _WEIGHT_FILE.fullmatch(src.name):
                shutil.copyfile(src, tmp / src.name)
                _publish(plan, tmp / src.name, src.name)
        config = dict(plan["config"])
        for key in ("dtype", "torch_dtype"):
            if key in config and config[key] != plan["dtype"]:
                logger.info("ray_train_tpu: exported config.json says %s=%s (the weights'), the base model %s",
                            key, plan["dtype"], config[key])
                config[key] = plan["dtype"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _publish(plan, tmp / "config.json", "config.json")
