"""torch.distributed over plain Ray actors on a TPU slice, without Ray Train.

The announcement's example: each actor holds ``resources={"TPU": 1}``; one
call builds the same environment and process group that `TPUTorchConfig`
builds for Ray Train workers (device "tpu" and backend "tpu_dist" on real
hardware, CPU and gloo in explicit simulation).

Example:
    >>> @ray.remote(resources={"TPU": 1})                      # doctest: +SKIP
    ... class Worker:
    ...     def all_reduce(self):
    ...         import torch, torch.distributed as dist
    ...         t = torch.ones(1, device=ray_train_tpu.get_device()) * dist.get_rank()
    ...         dist.all_reduce(t)
    ...         return t.item()
    >>> actors = [Worker.remote() for _ in range(8)]            # doctest: +SKIP
    >>> actors = setup_process_group(actors)                    # doctest: +SKIP
    >>> ray.get([a.all_reduce.remote() for a in actors])        # doctest: +SKIP
    [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0]
    >>> shutdown_process_group(actors)                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import ray

from ray_train_tpu import _worker_fns
from ray_train_tpu._backend import _TPUTorchBackend
from ray_train_tpu._compat.ray_train import call_in_actor as _call
from ray_train_tpu.config import TPUTorchConfig


class _ActorGroup:
    """The part of Ray Train's execution group that the backend uses."""

    def __init__(self, actors: Sequence[Any]):
        self._actors = list(actors)

    def __len__(self) -> int:
        return len(self._actors)

    def execute_async(self, fn: Callable, *args, **kwargs) -> List[ray.ObjectRef]:
        return [_call(a, fn, *args, **kwargs) for a in self._actors]

    def execute(self, fn: Callable, *args, **kwargs) -> list:
        return ray.get(self.execute_async(fn, *args, **kwargs))

    def execute_single_async(self, rank: int, fn: Callable, *args, **kwargs) -> ray.ObjectRef:
        return _call(self._actors[rank], fn, *args, **kwargs)

    def execute_single(self, rank: int, fn: Callable, *args, **kwargs):
        return ray.get(self.execute_single_async(rank, fn, *args, **kwargs))


def setup_process_group(actors: Sequence[Any], config: Optional[TPUTorchConfig] = None) -> list:
    """Build the TorchTPU environment and process group across `actors`.

    Returns:
        The actors in rank order (slice, TPU worker id, chip); actor *i* of the
        returned list is ``torch.distributed`` rank *i*.
    """
    config = config or TPUTorchConfig()
    reports = ray.get([_call(a, _worker_fns.report) for a in actors])
    backend = _TPUTorchBackend()
    ranks = backend.rank_order(reports, config)
    ordered = [actors[i] for i in ranks]
    backend.on_start(_ActorGroup(ordered), config)
    return ordered


def shutdown_process_group(actors: Sequence[Any]) -> None:
    """Destroy the process group in every actor."""
    _TPUTorchBackend().on_shutdown(_ActorGroup(actors), TPUTorchConfig())
