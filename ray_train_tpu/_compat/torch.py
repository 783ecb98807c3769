"""Every touch of a private torch API, pinned to `constants.TORCH_VERSION`.

DDP with a fixed gradient-bucket order (`fixed_order_ddp`) overrides
``DistributedDataParallel._build_params_for_reducer`` and calls
``Reducer._push_all_rebuilt_params`` (what DDP's own ``Join`` support calls);
tests/unit/test_strategies.py checks the buckets it gives.

torch has no public way to ask which backend owns the PrivateUse1 device slot
(torch_tpu registers "tpu" there); ``torch._C._get_privateuse1_backend_name``
is what ``torch.utils.backend_registration`` itself reads.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ray_train_tpu import constants as C

if TYPE_CHECKING:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

TESTED_TORCH_VERSION = C.TORCH_VERSION


def privateuse1_backend_name() -> str:
    """The device name registered for PrivateUse1 (``"tpu"`` once torch_tpu
    loaded on a TPU host; torch's default ``"privateuseone"`` otherwise)."""
    import torch

    return torch._C._get_privateuse1_backend_name()


def version_matches(version: str) -> bool:
    """True when `version` (``torch.__version__``) is the pinned major.minor."""
    return version.split("+")[0].startswith(TESTED_TORCH_VERSION + ".")


def fixed_order_ddp(model: "nn.Module", **kwargs) -> "DistributedDataParallel":
    """``DistributedDataParallel(model, **kwargs)`` whose gradient buckets are the
    same at every step of every run, so that a run resumed from a checkpoint sums
    gradients in the same order as an uninterrupted one (bitwise equal results).

    Plain DDP (without ``find_unused_parameters``) reduces its first step in one
    bucket and then rebuilds the buckets in the order the gradients became ready;
    a run resumed at step k thus reduces step k in one bucket where the
    uninterrupted run used the rebuilt ones, and with more than two ranks the
    all-reduce rounds differently (7.5e-9 after one resume). Here the rebuild is
    requested before the first forward (``Reducer._push_all_rebuilt_params``, what
    DDP's own ``Join`` support calls), from the parameters in reverse module order
    (the order backward produces them in, as DDP's own first guess assumes), so it
    happens once, identically in every run, the last layers' bucket is reduced
    first (all-reduce still overlaps the backward), and no per-step work is added.
    """
    ddp = _fixed_order_class()(model, **kwargs)
    ddp.reducer._push_all_rebuilt_params()  # torch >= 1.10; tests/unit/test_strategies.py checks the buckets
    return ddp


@functools.lru_cache(maxsize=None)
def _fixed_order_class():
    from torch.nn.parallel import DistributedDataParallel

    class FixedOrderDDP(DistributedDataParallel):
        """DDP whose reducer numbers the parameters in reverse module order."""

        def _build_params_for_reducer(self):
            params, sparse = super()._build_params_for_reducer()
            return params[::-1], sparse[::-1]

    FixedOrderDDP.__module__, FixedOrderDDP.__qualname__ = __name__, "FixedOrderDDP"
    return FixedOrderDDP


def __getattr__(name: str):
    # ``FixedOrderDDP`` without importing torch with this module (pickle finds it here).
    if name == "FixedOrderDDP":
        return _fixed_order_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def collective_sequence_numbers() -> dict:
    """``{group name: (global ranks, collectives issued)}`` for every process group
    of this process, or ``{}`` before ``init_process_group``.

    The count is c10d's own per-group sequence number
    (``ProcessGroup._get_sequence_number_for_group``), which gloo and NCCL advance
    when a rank *issues* a collective, DDP's C++ all-reduces included; a rank
    that never joins a collective the others wait in stays one behind. Safe to
    call from another thread while a collective blocks the training thread.
    A backend without sequence numbers (torch_tpu's ``tpu_dist`` is untested)
    reports None for its groups. ``_world.pg_map``/``pg_names`` are c10d's
    registry of groups (private)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for pg in list(c10d._world.pg_map):  # a copy: the training thread may add groups meanwhile
        try:
            ranks = tuple(sorted(c10d._world.pg_group_ranks[pg]))
            seq = int(pg._get_sequence_number_for_group())
        except (KeyError, RuntimeError, AttributeError, TypeError):  # destroyed meanwhile, or no counter
            continue
        out[c10d._world.pg_names.get(pg, str(id(pg)))] = (ranks, seq)
    return out


def batches_yielded(loader_iterator) -> int:
    """Batches a DataLoader iterator has handed out in this epoch
    (``_BaseDataLoaderIter._num_yielded``; torchdata's StatefulDataLoader
    restores it when it resumes an iterator)."""
    return int(getattr(loader_iterator, "_num_yielded", 0))
