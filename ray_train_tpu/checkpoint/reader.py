"""`load`: verify, then put model, optimizer, scheduler, data-loader position and RNG back."""

from __future__ import annotations

import random
from pathlib import Path

from ray_train_tpu.checkpoint._collective import _rank_world
from ray_train_tpu.checkpoint.manifest import (
    _RANK_FILE,
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    _digest,
    _fingerprint,
    _state_dicts,
    logger,
    verify,
)
from ray_train_tpu.checkpoint.writer import _accelerator_rng_module, _dcp_state, _optimizer_summary

def _set_rng_state(state: dict) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "accelerator" in state:
        device_type, device_state = state["accelerator"]
        here = _accelerator_rng_module()
        if here is not None and here[0] == device_type:
            here[1].set_rng_state(device_state)
        else:
            logger.warning("ray_train_tpu: the checkpoint's %s random-number state is not restored: this "
                           "process has not started a %s device", device_type, device_type)
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def load(directory, *, model, optimizer=None, lr_scheduler=None, dataloader=None, rng: bool = True) -> CheckpointInfo:
    """Verify a checkpoint, then load it into the given objects (call on every rank).

    Model and optimizer may be wrapped and sharded otherwise than when saved
    (DCP reshards), also on another number of ranks or slices. Data-loader
    position and RNG state are per rank: with another world size the
    ``dataloader`` (a `ray_train_tpu.data.stateful_dataloader`) resumes the
    epoch where the whole job was, re-sharded over this world, and the RNG is
    left as it is (a warning).
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
        if dataloader is not None:
            # Ranks read in lockstep, so rank 0's state says where the whole job was in
            # the epoch; the loader re-shards the rest over this world.
            dataloader.load_state_dict(torch.load(directory / _RANK_FILE.format(0), weights_only=True)["dataloader"])
        return
    payload = torch.load(directory / _RANK_FILE.format(rank), weights_only=True)
    if dataloader is not None:
        dataloader.load_state_dict(payload["dataloader"])
    if rng:
        _set_rng_state(payload["rng"])
