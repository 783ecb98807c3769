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
import inspect
import threading
from typing import TYPE_CHECKING

from ray_train_tpu import constants as C

if TYPE_CHECKING:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

TESTED_TORCH_VERSION = C.TORCH_VERSION
_install_lock = threading.Lock()


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


# -- counting collectives (hang detection): c10d numbers only its built-in backend types' collectives
# (GLOO/NCCL/XCCL/UCC); torch_tpu's ``tpu_dist`` is a custom backend without them, so entries are
# counted here, at the one seam every collective passes: the dispatcher's ``c10d`` ops. dist.*
# calls them through ProcessGroup's methods, DDP's C++ reducer through the same C++ methods, and
# functional collectives (DTensor, FSDP2) through those methods too. A Python kernel at the
# Autograd keys (which run before the device's kernel, for every tensor outside inference mode)
# counts the entry and redispatches below autograd, so each collective costs one Python call.

# point-to-point ops are left out: only two ranks take part, so counts differ by design
COUNTED_C10D_OPS = (
    "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "reduce_", "broadcast_", "gather_", "scatter_", "alltoall_",
    "alltoall_base_", "barrier", "monitored_barrier_",
)
# functional collectives (DTensor, FSDP2, torch.compile) name their group by a string argument
COUNTED_FUNCTIONAL_OPS = (
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out", "all_reduce",
    "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "all_to_all_single", "broadcast", "broadcast_",
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_out",
)
COUNTING_KEYS = ("AutogradCPU", "AutogradPrivateUse1", "AutogradCUDA")
_PG_TYPE = "__torch__.torch.classes.c10d.ProcessGroup"
_counter: dict = {}  # {"library": ..., "entries": {group name: count}, "lock": Lock}
_nesting = threading.local()


def install_collective_counter() -> None:
    """Count this process's collective entries per process group from now on
    (idempotent). `collective_entries` reads the counts."""
    import torch

    with _install_lock:
        if _counter:
            return
        import torch.distributed  # noqa: F401  (registers the _c10d_functional ops)

        libraries = []
        for namespace, names in (("c10d", COUNTED_C10D_OPS), ("_c10d_functional", COUNTED_FUNCTIONAL_OPS)):
            library = torch.library.Library(namespace, "IMPL")
            for name in names:
                op = getattr(getattr(torch.ops, namespace), name).default
                group_arg = [i for i, a in enumerate(op._schema.arguments) if a.name == "group_name"]
                for key in COUNTING_KEYS:
                    library.impl(name, _counting_kernel(op, group_arg[0] if group_arg else None), key)
            libraries.append(library)
        _counter.update(libraries=libraries, entries={}, lock=threading.Lock())


def _counting_kernel(op, group_name_at=None):
    import torch

    call = op._op  # the C++ callable (OpOverload.__call__ adds Python-side checks to every call)
    below_autograd = torch._C._AutoDispatchBelowAutograd

    def kernel(*args, **kwargs):
        depth = getattr(_nesting, "depth", 0)
        if depth == 0:  # a collective that runs another inside (functional -> c10d, the simulated host twin) counts once
            if group_name_at is None:
                _count_group(args)
            else:
                _count_name(args[group_name_at] if group_name_at < len(args) else kwargs["group_name"])
        _nesting.depth = depth + 1
        try:
            with below_autograd():
                return call(*args, **kwargs)
        finally:
            _nesting.depth = depth

    return kernel


def _count_group(args) -> None:
    import torch
    from torch._C._distributed_c10d import ProcessGroup

    for arg in args:
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name() == _PG_TYPE:
            _count_name(ProcessGroup.unbox(arg).group_name)
            return


def _count_name(name: str) -> None:
    with _counter["lock"]:
        _counter["entries"][name] = _counter["entries"].get(name, 0) + 1


def collective_entries() -> dict:
    """``{group name: (global ranks, collectives entered)}`` for every process
    group this process entered a collective of since `install_collective_counter`
    (``{}`` before). A rank that never joins a collective the others wait in
    stays one behind. Safe to call from another thread while a collective blocks
    the training thread. ``_world.pg_names``/``pg_group_ranks`` are c10d's
    registry of groups (private)."""
    if not _counter:
        return {}
    with _counter["lock"]:
        entries = dict(_counter["entries"])
    ranks = {}
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        for pg, name in list(c10d._world.pg_names.items()):  # a copy: the training thread may add groups
            try:
                ranks[name] = tuple(sorted(c10d._world.pg_group_ranks[pg]))
            except KeyError:  # destroyed meanwhile
                continue
    return {name: (ranks.get(name, ()), n) for name, n in entries.items()}


def carry_barrier_device_ids(local_rank: int) -> None:
    """Inside a TPU worker (one device per process, ``tpu:0``), let the GPU idiom
    ``dist.barrier(device_ids=[local_rank])`` mean this process's own device:
    ``device_ids=[0]``, the one value torch_tpu's ``ProcessGroupTpu`` accepts.
    Any other ``device_ids`` fails at once, naming the fix (idempotent)."""
    import torch.distributed as dist

    barrier = dist.barrier
    if getattr(barrier, "_ray_train_tpu_local_rank", None) is not None:
        barrier._ray_train_tpu_local_rank = local_rank
        return

    signature = inspect.signature(barrier)

    @functools.wraps(barrier)
    def tpu_barrier(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        device_ids = bound.arguments.get("device_ids")
        if device_ids is not None:
            ids = [device_ids] if isinstance(device_ids, int) else list(device_ids)
            mine = tpu_barrier._ray_train_tpu_local_rank
            if ids not in ([mine], [0]):
                raise ValueError(
                    f"dist.barrier(device_ids={device_ids!r}): this TPU worker has one device (local rank {mine}); "
                    f"torch_tpu's tpu_dist accepts only device_ids=[0]. Leave device_ids out, or pass "
                    f"[{mine}] (LOCAL_RANK, mapped to [0] here) or [0]"
                )
            bound.arguments["device_ids"] = [0]
        return barrier(*bound.args, **bound.kwargs)

    tpu_barrier._ray_train_tpu_local_rank = local_rank
    dist.barrier = tpu_barrier


def batches_yielded(loader_iterator) -> int:
    """Batches a DataLoader iterator has handed out in this epoch
    (``_BaseDataLoaderIter._num_yielded``; torchdata's StatefulDataLoader
    restores it when it resumes an iterator)."""
    return int(getattr(loader_iterator, "_num_yielded", 0))


def batches_in_loader_state(loader_state: dict) -> int:
    """Batches the epoch's iterator had handed out when torchdata's
    ``StatefulDataLoader.state_dict()`` was taken (its ``_num_yielded``; 0 for
    a fresh state)."""
    return int((loader_state or {}).get("_num_yielded", 0) or 0)
