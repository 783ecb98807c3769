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
for DDP, fixed gradient buckets: plain DDP rebuilds its buckets after its first
iteration, so a restarted DDP would sum its first step's gradients in another
order (last-bit differences); ``DDPStrategy`` (``strategy="ddp"``, the default)
fixes them before the first step.

`export_hf` turns a checkpoint's model into a Hugging Face directory
(safetensors + the base model's config and tokenizer) for serving and RL.

Example:
    >>> from ray_train_tpu import checkpoint
    >>> checkpoint.save(f"/ckpt/step_{step}", model=model, optimizer=opt, step=step)  # doctest: +SKIP
    >>> checkpoint.load(f"/ckpt/step_{step}", model=model, optimizer=opt).step        # doctest: +SKIP
    100
"""


from ray_train_tpu.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    fingerprint,
    latest_checkpoint,
    verify,
)
from ray_train_tpu.checkpoint.export import ExportError, ExportInfo, export_hf
from ray_train_tpu.checkpoint.preemption import Preempted, PreemptionGuard
from ray_train_tpu.checkpoint.reader import load
from ray_train_tpu.checkpoint.reporting import report, restore
from ray_train_tpu.checkpoint.writer import AsyncSave, save, wait

__all__ = [
    "FORMAT", "MANIFEST", "AsyncSave", "CheckpointError", "CheckpointInfo", "CheckpointNotFoundError",
    "ExportError", "ExportInfo", "export_hf",
    "Preempted", "PreemptionGuard",
    "fingerprint", "latest_checkpoint", "load", "report", "restore", "save", "verify", "wait",
]
