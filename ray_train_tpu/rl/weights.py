"""Weights from the trainer to the engines: buckets in Ray's object store, and
bitwise parity, shard by shard.

**Transfer.** Every trainer rank holds each parameter sharded along dim 0
(FSDP2), under its Hugging Face name. After an update it casts its shards to
the engine's dtype on the host and puts them in Ray's object store in buckets
of about ``sync_bucket_mb`` (the same parameter groups on every rank,
`plan_buckets`), each a list of ``(name, dtype, shape, numpy array)``: numpy
arrays come back from the object store as zero-copy views of shared memory, so
an engine worker reads a bucket without copying it. Each engine worker (every
TP rank) concatenates the ranks' shards of a parameter and hands the full
tensor to vLLM's loader, which copies the worker's own TP slice into its
weights; all buckets are requested at once, so later buckets travel while
earlier ones load.

**Parity.** The engine holds some parameters fused (vLLM's
``packed_modules_mapping``: ``qkv_proj`` = ``[q_proj; k_proj; v_proj]`` along dim
0), and with tensor parallelism each TP rank a slice of each (rows, or columns
for row-parallel layers; `ray_train_tpu._compat.vllm.linear_specs`). Both
sides cut their tensors into the same blocks, one per (trainer shard, TP
rank), keyed ``"<hf name>#<shard>"`` (``"...@tp<r>"`` with TP), and hash each
(`block_slices`): nothing is gathered to check parity.

Signed zeros: the engine reads linear layers back through their kernels, where
``-0.0`` comes back as ``+0.0``; digests are taken of ``t + 0.0``.

Example:
    >>> import torch
    >>> packed = {"qk_proj": ["q_proj", "k_proj"]}
    >>> hf_names("l.qk_proj.weight", packed)
    ['l.q_proj.weight', 'l.k_proj.weight']
    >>> block_slices((0, 1, 2), [2, 2])        # TP slice rows 1..2 over shards of rows 0-1 and 2-3
    [(0, (slice(0, 1, None),), (slice(1, 2, None),)), (1, (slice(1, 2, None),), (slice(0, 1, None),))]
    >>> plan_buckets([("a", 100), ("b", 100), ("c", 300)], bucket_bytes=250)
    [['a', 'b'], ['c']]
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Iterable, Mapping, Optional, Sequence

import torch

# A TP rank's slice of a Hugging Face tensor: (dim, start, length); None: all of it.
TPSpec = Optional[tuple[int, int, int]]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's dtype, shape and bytes (``-0.0`` taken as ``+0.0``)."""
    t = (tensor.detach() + 0.0).to(tensor.dtype).contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def block_key(name: str, shard: int, tp_rank: Optional[int] = None) -> str:
    return f"{name}#{shard}" if tp_rank is None else f"{name}#{shard}@tp{tp_rank}"


# --- buckets ------------------------------------------------------------------------


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Parameter names in consecutive groups of about ``bucket_bytes`` (full
    sizes, the same on every rank); a parameter larger than that is alone."""
    out, current, filled = [], [], 0
    for name, nbytes in sizes:
        if current and filled + nbytes > bucket_bytes:
            out.append(current)
            current, filled = [], 0
        current.append(name)
        filled += nbytes
    if current:
        out.append(current)
    return out


def pack(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple]:
    """Host tensors -> ``[(name, dtype name, shape, numpy array)]`` for ``ray.put``
    (the array is the tensor's bytes viewed as an integer type: numpy has no bfloat16)."""
    out = []
    for name, t in named:
        t = t.contiguous()
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                    t.view(_INT_VIEW[t.element_size()]).numpy()))
    return out


def unpack(bucket: Sequence[tuple]) -> list[tuple[str, torch.Tensor]]:
    """`pack`'s inverse: tensors viewing the arrays (read-only shared memory
    after ``ray.get``: write to them and the object store refuses)."""
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, dtype, shape, array in bucket:
            out.append((name, torch.from_numpy(array).view(getattr(torch, dtype)).view(shape)))
    return out


def assemble(shard_buckets: Sequence[Sequence[tuple]]) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """One bucket from every trainer rank (rank order) -> ``[(name, full tensor)]``
    and ``{name: rows of each shard}``."""
    per_rank = [unpack(b) for b in shard_buckets]
    names = [n for n, _ in per_rank[0]]
    layout, out = {}, []
    for i, name in enumerate(names):
        shards = [rank[i][1] for rank in per_rank]
        if any(rank[i][0] != name for rank in per_rank):
            raise RuntimeError(f"trainer ranks sent buckets with different parameters at {name!r}: the bucket plan "
                               "must be the same on every rank")
        layout[name] = [s.shape[0] for s in shards]
        out.append((name, shards[0] if len(shards) == 1 else torch.cat(shards)))
    return out, layout


class WeightMailbox:
    """A Ray actor holding the latest update's bucket references for the engines'
    workers to fetch. vLLM hands RPC arguments to its Ray workers through its own
    message queue (plain pickle), where an ObjectRef loses the owner bookkeeping
    that ``ray.get`` needs (it waits forever); an actor call returns them intact."""

    def __init__(self):
        self.version, self.buckets = -1, None

    def put(self, version: int, wrapped: list) -> int:
        self.version, self.buckets = version, wrapped[0]  # wrapped: Ray passes nested refs as refs
        return version

    def get(self, version: int) -> list:
        if version != self.version:
            raise RuntimeError(f"weights version {version} asked for, but the mailbox holds version {self.version}")
        return [self.buckets]


# --- parity -------------------------------------------------------------------------


def hf_names(engine_name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The trainer's names of the pieces of one engine tensor (itself if not fused)."""
    parts = engine_name.split(".")
    for fused, pieces in packed.items():
        if fused in parts:
            i = parts.index(fused)
            return [".".join(parts[:i] + [p] + parts[i + 1:]) for p in pieces]
    return [engine_name]


def block_slices(spec: TPSpec, rows_per_shard: Sequence[int]) -> list[tuple[int, tuple, tuple]]:
    """The blocks of one TP slice of a tensor, one per trainer shard it meets:
    ``(shard, index into the slice, index into the shard)``.

    ``spec`` None: the whole tensor; ``(0, start, length)``: rows; ``(1, start,
    length)``: columns (every shard meets it)."""
    out, offset = [], 0
    for shard, rows in enumerate(rows_per_shard):
        lo, hi = offset, offset + rows
        offset = hi
        if spec is None:
            out.append((shard, (slice(lo, hi),), (slice(0, rows),)))
        elif spec[0] == 0:
            a, b = max(lo, spec[1]), min(hi, spec[1] + spec[2])
            if a < b:
                out.append((shard, (slice(a - spec[1], b - spec[1]),), (slice(a - lo, b - lo),)))
        else:
            cols = slice(spec[1], spec[1] + spec[2])
            out.append((shard, (slice(lo, hi),), (slice(0, rows), cols)))
    return out


def engine_digests(engine_name: str, tensor: torch.Tensor, specs: Sequence[TPSpec], tp_rank: Optional[int],
                   packed: Mapping[str, Sequence[str]], layout: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """Digests of one engine tensor (this TP rank's part of it, pieces fused
    along dim 0) cut into the trainer's shards, keyed `block_key`."""
    names = hf_names(engine_name, packed)
    missing = [n for n in names if n not in layout]
    if missing:
        raise KeyError(f"engine tensor {engine_name!r} has no counterpart {missing} in the weights the trainer "
                       f"sent (packed modules {dict(packed)}); is the engine serving another model?")
    if len(specs) != len(names):
        raise RuntimeError(f"engine tensor {engine_name!r}: {len(specs)} TP slices for {len(names)} pieces {names}")
    sizes = [sum(layout[n]) if s is None or s[0] == 1 else s[2] for n, s in zip(names, specs)]
    out = {}
    for name, spec, piece in zip(names, specs, tensor.split(sizes, dim=0)):
        for shard, local, _ in block_slices(spec, layout[name]):
            out[block_key(name, shard, tp_rank)] = digest(piece[local])
    return out


def trainer_digests(shard: int, tensors: Mapping[str, torch.Tensor], layout: Mapping[str, Sequence[int]],
                    specs: Optional[Mapping[str, Sequence[TPSpec]]] = None) -> dict[str, str]:
    """Digests of a trainer rank's published shards, cut into the blocks each
    engine TP rank holds (``specs[name][tp_rank]``; None: engines without TP)."""
    out = {}
    for name, t in tensors.items():
        per_rank = [None] if specs is None else specs.get(name, [None])
        for tp_rank, spec in enumerate(per_rank):
            for s, _, mine in block_slices(spec, layout[name]):
                if s == shard:
                    out[block_key(name, shard, None if specs is None else tp_rank)] = digest(t[mine])
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (NaNs and signed
    zeros included: no arithmetic comparison).

    Example:
        >>> same_bits(torch.tensor([0.0]), torch.tensor([-0.0])), same_bits(torch.ones(2), torch.ones(2))
        (False, True)
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def safetensors_files(model_dir: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a Hugging Face directory: from its
    ``model.safetensors.index.json`` if it has one, else every ``*.safetensors``
    file's header."""
    import json
    import os

    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    out = {}
    for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        path = os.path.join(model_dir, file)
        with safe_open(path, framework="pt") as handle:
            out.update({name: path for name in handle.keys()})
    return out


def mismatches(trainer: Mapping[str, str], engine: Mapping[str, str]) -> list[str]:
    """Keys whose digests differ or that only one side holds, one line each."""
    out = [f"{n}: digest differs" for n in sorted(set(trainer) & set(engine)) if trainer[n] != engine[n]]
    out += [f"{n}: in the engine, not in the trainer" for n in sorted(set(engine) - set(trainer))]
    out += [f"{n}: in the trainer, not in the engine" for n in sorted(set(trainer) - set(engine))]
    return out
