"""Weight parity between the trainer and the rollout engine, bit for bit, shard by shard.

The trainer holds each parameter sharded along dim 0 (FSDP2), under its Hugging
Face name; the engine holds some parameters fused (vLLM's
``packed_modules_mapping``: ``qkv_proj`` = ``[q_proj; k_proj; v_proj]`` along
dim 0) and whole. Both sides therefore describe their weights the same way: a
digest per ``"<hf name>#<shard>"``, the engine splitting its tensors back into
the pieces and rows the trainer sent (`split_digests`). Nothing is gathered to
check parity.

Signed zeros: the engine reads linear layers back through their kernels (see
``_vllm_worker``), where ``-0.0`` comes back as ``+0.0``; digests are taken of
``t + 0.0``, which maps ``-0.0`` to ``+0.0`` and changes nothing else.

Example:
    >>> import torch
    >>> packed = {"qk_proj": ["q_proj", "k_proj"]}
    >>> hf_names("l.qk_proj.weight", packed)
    ['l.q_proj.weight', 'l.k_proj.weight']
    >>> fused = torch.arange(6.0).view(3, 2)          # q: rows 0-1, k: row 2
    >>> layout = {"l.q_proj.weight": [1, 1], "l.k_proj.weight": [1, 0]}
    >>> sorted(split_digests("l.qk_proj.weight", fused, packed, layout))
    ['l.k_proj.weight#0', 'l.k_proj.weight#1', 'l.q_proj.weight#0', 'l.q_proj.weight#1']
    >>> mismatches({"a": digest(torch.ones(2))}, {"a": digest(torch.ones(2)), "b": "x"})
    ['b: in the engine, not in the trainer']
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import torch


def digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's dtype, shape and bytes (``-0.0`` taken as ``+0.0``)."""
    t = (tensor.detach() + 0.0).to(tensor.dtype).contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard_key(name: str, shard: int) -> str:
    return f"{name}#{shard}"


def hf_names(engine_name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The trainer's names of the pieces of one engine tensor (itself if not fused)."""
    parts = engine_name.split(".")
    for fused, pieces in packed.items():
        if fused in parts:
            i = parts.index(fused)
            return [".".join(parts[:i] + [p] + parts[i + 1:]) for p in pieces]
    return [engine_name]


def split_digests(engine_name: str, tensor: torch.Tensor, packed: Mapping[str, Sequence[str]],
                  layout: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Digests of one engine tensor cut into the trainer's pieces and shards:
    ``layout[hf_name]`` is the rows of that tensor in each shard, in shard order."""
    names = hf_names(engine_name, packed)
    missing = [n for n in names if n not in layout]
    if missing:
        raise KeyError(f"engine tensor {engine_name!r} has no counterpart {missing} in the weights the trainer "
                       f"sent (packed modules {dict(packed)}); is the engine serving another model?")
    out = {}
    pieces = tensor.split([sum(layout[n]) for n in names], dim=0)
    for name, piece in zip(names, pieces):
        for shard, part in enumerate(piece.split(list(layout[name]), dim=0)):
            out[shard_key(name, shard)] = digest(part)
    return out


def mismatches(trainer: Mapping[str, str], engine: Mapping[str, str]) -> list[str]:
    """Keys whose digests differ or that only one side holds, one line each."""
    out = [f"{n}: digest differs" for n in sorted(set(trainer) & set(engine)) if trainer[n] != engine[n]]
    out += [f"{n}: in the engine, not in the trainer" for n in sorted(set(engine) - set(trainer))]
    out += [f"{n}: in the trainer, not in the engine" for n in sorted(set(trainer) - set(engine))]
    return out
