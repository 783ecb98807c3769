"""`stateful_dataloader`: a rank-sharded torchdata ``StatefulDataLoader`` that resumes exactly.

Each rank reads its own shard (a ``DistributedSampler`` with a fixed seed), and
``state_dict()`` holds the epoch and how far into it this rank has read, so a
loader built the same way after a restart and given that state yields exactly
the batches the interrupted run had not yet seen. `ray_train_tpu.checkpoint`
saves it per rank.

Example:
    >>> from ray_train_tpu.data import stateful_dataloader
    >>> loader = stateful_dataloader(list(range(8)), batch_size=2, rank=0, world_size=2)
    >>> loader.set_epoch(0)
    >>> [b.tolist() for b in loader]
    [[4, 7], [2, 1]]
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

logger = logging.getLogger(__name__)

# StatefulDataLoader's flag for "this epoch's iterator ran to its end".
_FINISHED = "_iterator_finished"


class ShardedStatefulDataLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` over one rank's shard; build it with `stateful_dataloader`.

    ``set_epoch(e)`` reshuffles for epoch ``e`` (as ``DistributedSampler.set_epoch``).
    ``state_dict()`` / ``load_state_dict()`` also carry the epoch and the sharding,
    and ``epoch`` is the epoch to (re)start after loading a state.
    """

    def __init__(self, dataset, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                 rank: int, world_size: int, **kwargs):
        sampler = StatefulDistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        if kwargs.get("generator") is None:
            # Each new iterator draws a base seed; from the global RNG that would
            # shift the model's random stream (dropout) after a resume.
            kwargs["generator"] = torch.Generator().manual_seed(seed)
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
        self._epoch = 0
        self._generator_at_iter = None  # the generator before the current iterator drew from it
        self._sharding = {
            "world_size": world_size, "rank": rank, "seed": seed, "shuffle": shuffle,
            "drop_last": drop_last, "batch_size": batch_size, "num_samples": len(dataset),
        }

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` at the next iteration. After `load_state_dict`,
        setting the epoch it restored keeps the restored position; another epoch
        discards it (with a warning) and starts that epoch from its beginning."""
        if epoch != self._epoch and self.next_iter_state is not None:
            logger.warning(
                "ray_train_tpu.data: set_epoch(%d) discards the position restored in epoch %d", epoch, self._epoch
            )
            self.next_iter_state = None
        self._epoch = epoch
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return self._drawing(super().__iter__)

    def _drawing(self, fn):
        """Call ``fn``; if it started an iterator (which draws from the generator),
        remember the generator as it was, so that a resumed iterator draws the same."""
        before = self.generator.get_state()
        out = fn()
        if not torch.equal(before, self.generator.get_state()):
            self._generator_at_iter = before
        return out

    def state_dict(self) -> dict:
        loader = self._drawing(super().state_dict)
        epoch, generator = self._epoch, self._generator_at_iter
        if loader.get(_FINISHED):
            # The epoch was read to its end: resume at the start of the next one.
            epoch, loader, generator = epoch + 1, {}, self.generator.get_state()
        return {"epoch": epoch, "sharding": dict(self._sharding), "loader": loader, "generator": generator}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"stateful_dataloader: load_state_dict needs a dict, got {type(state_dict).__name__}")
        for key in ("epoch", "sharding", "loader"):
            if key not in state_dict:
                raise ValueError(
                    f"stateful_dataloader: load_state_dict got a state without {key!r} (keys "
                    f"{sorted(state_dict)}); pass what ShardedStatefulDataLoader.state_dict() returned"
                )
        saved = state_dict["sharding"]
        for field, ours in self._sharding.items():
            if saved.get(field) != ours:
                raise ValueError(
                    f"stateful_dataloader: the state was saved with {field}={saved.get(field)!r}, this loader "
                    f"has {field}={ours!r}; a position resumes exactly only with the same sharding: build "
                    f"the loader with {field}={saved.get(field)!r}, or start the epoch afresh"
                )
        self._epoch = state_dict["epoch"]
        self.sampler.set_epoch(self._epoch)
        if state_dict.get("generator") is not None:
            self.generator.set_state(state_dict["generator"])
        super().load_state_dict(state_dict["loader"])


def stateful_dataloader(
    dataset,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int = 0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    **kwargs,
) -> ShardedStatefulDataLoader:
    """A resumable data loader over this rank's shard of a map-style ``dataset``.

    Args:
        batch_size: samples per batch on each rank.
        shuffle, seed: shuffle with ``seed + epoch`` (the same on every rank).
        drop_last: drop the tail that does not divide evenly among the ranks,
            and a last incomplete batch (False pads the shards by repeating samples).
        num_workers: loader worker processes, as in ``DataLoader``.
        rank, world_size: default: from torch.distributed if it is initialized,
            else Ray Train's context in a Ray Train worker, else 0 and 1.
        **kwargs: more ``StatefulDataLoader`` arguments (``collate_fn``, ...).

    Call ``loader.set_epoch(epoch)`` before each epoch; after loading a state,
    resume at ``loader.epoch``:

    Example:
        >>> loader = stateful_dataloader(list(range(8)), batch_size=2, rank=0, world_size=1)
        >>> it = iter(loader); first = next(it)
        >>> state = loader.state_dict()
        >>> again = stateful_dataloader(list(range(8)), batch_size=2, rank=0, world_size=1)
        >>> again.load_state_dict(state)
        >>> again.set_epoch(again.epoch)
        >>> len(list(again))   # the 3 batches not yet seen
        3
    """
    for field, value in (("batch_size", batch_size), ("seed", seed), ("num_workers", num_workers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if field == "batch_size" else 0):
            raise ValueError(f"stateful_dataloader({field}={value!r}) must be an integer >= "
                             f"{1 if field == 'batch_size' else 0}")
    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise ValueError("stateful_dataloader shards with its own sampler; do not pass sampler or batch_sampler")
    rank, world_size = _rank_world(rank, world_size)
    return ShardedStatefulDataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
        rank=rank, world_size=world_size, num_workers=num_workers, **kwargs,
    )


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"stateful_dataloader needs both rank and world_size, or neither (taken from the "
            f"process group); got rank={rank!r}, world_size={world_size!r}"
        )
    if rank is None:
        rank, world_size = _detected_rank_world()
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"stateful_dataloader(rank={rank!r}, world_size={world_size!r}): rank must be an integer "
            "in 0..world_size-1"
        )
    return rank, world_size


def _detected_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "ray" in sys.modules:
        import ray
        import ray.train

        if ray.is_initialized():
            try:
                ctx = ray.train.get_context()
                return ctx.get_world_rank(), ctx.get_world_size()
            except (RuntimeError, AttributeError):  # not in a Ray Train worker
                pass
    return 0, 1
