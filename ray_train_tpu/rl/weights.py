"""Weight parity between the trainer and the rollout engine, bit for bit.

The engine holds some weights fused (vLLM's ``packed_modules_mapping``: e.g.
``qkv_proj`` = ``[q_proj; k_proj; v_proj]`` along dim 0) where the trainer's
Hugging Face model holds them apart. `engine_layout` builds, from the trainer's
full state dict, the tensor the engine should hold under each of its names;
`digest` hashes a tensor's bytes; `mismatches` names every tensor that differs.

Signed zeros: the engine side reads linear layers back through their kernels
(see ``_vllm_worker``), where ``-0.0`` comes back as ``+0.0``; digests are
taken of ``t + 0.0``, which maps ``-0.0`` to ``+0.0`` and changes nothing else.

Example:
    >>> import torch
    >>> sd = {"l.q_proj.weight": torch.ones(2, 3), "l.k_proj.weight": torch.zeros(1, 3)}
    >>> t = engine_layout(sd, ["l.qk_proj.weight"], {"qk_proj": ["q_proj", "k_proj"]})
    >>> t["l.qk_proj.weight"].shape
    torch.Size([3, 3])
    >>> mismatches({"a": digest(torch.ones(2))}, {"a": digest(torch.ones(2)), "b": "x"})
    ['b: in the engine, not in the trainer']
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping, Optional

import torch


def digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's dtype, shape and bytes (``-0.0`` taken as ``+0.0``)."""
    t = (tensor.detach() + 0.0).to(tensor.dtype).contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _unpacked_names(name: str, packed: Mapping[str, list]) -> Optional[list[str]]:
    parts = name.split(".")
    for fused, pieces in packed.items():
        if fused in parts:
            i = parts.index(fused)
            return [".".join(parts[:i] + [p] + parts[i + 1:]) for p in pieces]
    return None


def engine_layout(state_dict: Mapping[str, torch.Tensor], names: Iterable[str],
                  packed: Mapping[str, list], tied: Mapping[str, str] = None) -> dict[str, torch.Tensor]:
    """The tensor the engine should hold under each of ``names``, from the trainer's
    unfused ``state_dict``; ``tied`` maps an engine name to the state-dict name it
    shares (e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    tied = dict(tied or {})
    out = {}
    for name in names:
        pieces = _unpacked_names(name, packed)
        if pieces is not None and all(p in state_dict for p in pieces):
            out[name] = torch.cat([state_dict[p] for p in pieces], dim=0)
        elif name in state_dict:
            out[name] = state_dict[name]
        elif name in tied and tied[name] in state_dict:
            out[name] = state_dict[tied[name]]
        else:
            raise KeyError(f"engine tensor {name!r} has no counterpart in the trainer's state dict "
                           f"(packed modules {dict(packed)}); is the engine serving another model?")
    return out


def mismatches(trainer: Mapping[str, str], engine: Mapping[str, str]) -> list[str]:
    """Names whose digests differ or that only one side holds, one line each."""
    out = [f"{n}: digest differs" for n in sorted(set(trainer) & set(engine)) if trainer[n] != engine[n]]
    out += [f"{n}: in the engine, not in the trainer" for n in sorted(set(engine) - set(trainer))]
    out += [f"{n}: in the trainer, not in the engine" for n in sorted(set(trainer) - set(engine))]
    return out
