"""`stateful_dataloader`: a rank-sharded torchdata ``StatefulDataLoader`` that resumes exactly.

Each data-parallel rank reads its own shard (a ``DistributedSampler`` with a
fixed seed; tensor-parallel peers read the same one), and
``state_dict()`` holds the epoch and how far into it this rank has read, so a
loader built the same way after a restart and given that state yields exactly
the batches the interrupted run had not yet seen. `ray_train_tpu.checkpoint`
saves it per rank.

Across a world-size change (an elastic job that lost or regained slices) the
state also says how many samples of the epoch's order the whole job consumed
(every rank takes the same number of batches, as data-parallel training does);
a loader of the new world resumes the epoch right after them, sharding the rest
over its ranks as ``DistributedSampler`` shards a whole epoch. Within an epoch
no sample is seen twice or skipped (with ``drop_last``, only the last
``world_size - 1`` samples that do not split evenly, as always).

Batch policy (docs/elastic.md): ``global_batch_size=`` keeps the global batch
(the per-rank batch is ``global_batch_size // world_size``, so each step and the
learning-rate schedule see the same number of samples whatever the slices);
``batch_size=`` keeps the per-rank batch (the global batch changes with the slices).

Example:
    >>> from ray_train_tpu.data import stateful_dataloader
    >>> loader = stateful_dataloader(list(range(8)), batch_size=2, rank=0, world_size=2)
    >>> loader.set_epoch(0)
    >>> [b.tolist() for b in loader]
    [[4, 7], [2, 1]]
"""

from __future__ import annotations

import itertools
import logging
import sys
from typing import Optional

import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from ray_train_tpu._compat import torch as compat_torch
from ray_train_tpu.prepare import data_parallel_shard

logger = logging.getLogger(__name__)

# StatefulDataLoader's flag for "this epoch's iterator ran to its end".
_FINISHED = "_iterator_finished"


class _ShardSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` plus ``start``: the epoch's
    first ``start`` samples (in its order) were consumed by a job of another
    world size; the rest is padded or trimmed for this one and sharded as
    ``DistributedSampler`` shards a whole epoch. ``start=0`` is torchdata's."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0  # the position of a world-size change belongs to its epoch only
        super().set_epoch(epoch)

    def __iter__(self):
        if not self.start:
            return super().__iter__()
        return self._rest_of_shard()

    def __len__(self) -> int:
        return super().__len__() if not self.start else len(self._rest()) // self.num_replicas

    def state_dict(self) -> dict:
        # torchdata's sampler applies a loaded position only once its generator starts;
        # a state taken before that (restore, then save before the first batch) must
        # still hold the loaded position, or the next resume reads those samples again.
        yielded = self.yielded if self.next_yielded is None else self.next_yielded
        return {self._YIELDED: yielded}

    def _rest_of_shard(self):
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        for idx in itertools.islice(self._rest()[self.rank::self.num_replicas], self.yielded, None):
            self.yielded += 1
            yield idx

    def _rest(self) -> list:
        # The epoch's order from DistributedSampler itself (one replica, nothing dropped).
        whole = DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        whole.set_epoch(self.epoch)
        order = list(whole)
        rest = order[self.start:]
        extra = len(rest) % self.num_replicas
        if self.drop_last:
            return rest[: len(rest) - extra]
        pad = (self.num_replicas - extra) % self.num_replicas
        return rest + (order * (pad // max(1, len(order)) + 1))[:pad]  # as DistributedSampler pads


class ShardedStatefulDataLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` over one rank's shard; build it with `stateful_dataloader`.

    ``set_epoch(e)`` reshuffles for epoch ``e`` (as ``DistributedSampler.set_epoch``).
    ``state_dict()`` / ``load_state_dict()`` also carry the epoch and the sharding,
    and ``epoch`` is the epoch to (re)start after loading a state.
    """

    def __init__(self, dataset, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                 rank: int, world_size: int, global_batch_size: Optional[int] = None, **kwargs):
        sampler = _ShardSampler(
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
            "global_batch_size": global_batch_size,
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

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks."""
        return self._sharding["batch_size"] * self._sharding["world_size"]

    def state_dict(self) -> dict:
        loader = self._drawing(super().state_dict)
        epoch, generator, start = self._epoch, self._generator_at_iter, self.sampler.start
        if loader.get(_FINISHED):
            # The epoch was read to its end: resume at the start of the next one.
            epoch, loader, generator, start = epoch + 1, {}, self.generator.get_state(), 0
        # The whole job's position in the epoch's order (ranks read in lockstep).
        consumed = start if not loader else min(
            self._sharding["num_samples"],
            start + self.global_batch_size * compat_torch.batches_yielded(self._iterator))
        return {"epoch": epoch, "sharding": dict(self._sharding), "loader": loader, "generator": generator,
                "start": start, "consumed": consumed}

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
        ours = self._sharding
        resharding = (saved.get("world_size"), saved.get("rank")) != (ours["world_size"], ours["rank"])
        self._check_sharding(saved, resharding)
        self._epoch = state_dict["epoch"]
        self.sampler.set_epoch(self._epoch)
        if state_dict.get("generator") is not None:
            self.generator.set_state(state_dict["generator"])
        if not resharding:
            self.sampler.start = state_dict.get("start", 0)
            super().load_state_dict(state_dict["loader"])
            self._next_epoch_if_read_to_its_end(state_dict["loader"], self.sampler.start > 0)
            return
        if "consumed" not in state_dict:
            raise ValueError("stateful_dataloader: the state has no 'consumed' position (saved by an older "
                             "ray_train_tpu); it resumes only with the same world_size and rank")
        self.sampler.start = state_dict["consumed"]
        super().load_state_dict({})  # a fresh iterator over the rest of the epoch
        logger.info("ray_train_tpu.data: epoch %d resumes at sample %d of %d, re-sharded from %d to %d ranks",
                    self._epoch, state_dict["consumed"], saved["num_samples"], saved["world_size"],
                    self._sharding["world_size"])
        self._next_epoch_if_read_to_its_end({}, state_dict["consumed"] > 0)

    def _next_epoch_if_read_to_its_end(self, loader_state: dict, resharded_mid_epoch: bool) -> None:
        """A state saved on an epoch's last step (before its iterator noticed the
        end; or whose rest holds no batch for this world size) resumes at the next
        epoch's start, as a state saved after the end does. Otherwise this loader
        yields nothing in the restored epoch, and a loop over it takes no step.
        (An epoch too small to give this world any batch at all stays as it is.)"""
        read = compat_torch.batches_in_loader_state(loader_state)
        if len(self) > read or not (read or resharded_mid_epoch):
            return
        leftover = list(self)  # the restored iterator ends at once (drawing what it draws)
        if leftover:
            raise RuntimeError(f"stateful_dataloader: {len(leftover)} batch(es) left where none were expected")
        logger.info("ray_train_tpu.data: epoch %d was read to its end; resuming at the start of epoch %d",
                    self._epoch, self._epoch + 1)
        self.set_epoch(self._epoch + 1)

    def _check_sharding(self, saved: dict, resharding: bool) -> None:
        """The same data and order; across a world-size change, the same batch policy."""
        fields = ["seed", "shuffle", "drop_last", "num_samples"]
        if not resharding:
            fields += ["world_size", "rank", "batch_size"]
        elif saved.get("global_batch_size") is not None or self._sharding["global_batch_size"] is not None:
            fields += ["global_batch_size"]
        else:
            fields += ["batch_size"]  # the per-rank batch policy keeps it
        for field in fields:
            theirs, ours = saved.get(field), self._sharding[field]
            if theirs != ours:
                raise ValueError(
                    f"stateful_dataloader: the state was saved with {field}={theirs!r}, this loader "
                    f"has {field}={ours!r}; a position resumes only with the same data, order and batch "
                    f"policy: build the loader with {field}={theirs!r}, or start the epoch afresh"
                )


def stateful_dataloader(
    dataset,
    *,
    batch_size: Optional[int] = None,
    global_batch_size: Optional[int] = None,
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
        batch_size: samples per batch on each rank (kept across a world-size change).
        global_batch_size: samples per step over all ranks, kept across a
            world-size change (each rank takes ``global_batch_size // world_size``);
            give this or ``batch_size``. It must divide by every world size the job
            may run at (an elastic job: each slice count in its range).
        shuffle, seed: shuffle with ``seed + epoch`` (the same on every rank).
        drop_last: drop the tail that does not divide evenly among the ranks,
            and a last incomplete batch (False pads the shards by repeating samples).
        num_workers: loader worker processes, as in ``DataLoader``.
        rank, world_size: this rank's place among the data-parallel replicas.
            Default: from the job's device mesh (`prepare.data_parallel_shard`:
            tensor-parallel peers share a shard), else torch.distributed's rank
            and world size if it is initialized, else Ray Train's context in a
            Ray Train worker, else 0 and 1. Values that contradict the mesh are
            refused.
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
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError(
            f"stateful_dataloader(batch_size={batch_size!r}, global_batch_size={global_batch_size!r}): give "
            "exactly one: global_batch_size keeps the samples per step when the world size changes, "
            "batch_size keeps the samples per rank")
    sizes = (("batch_size", batch_size), ("global_batch_size", global_batch_size))
    for field, value in [(f, v) for f, v in sizes if v is not None] + [("seed", seed), ("num_workers", num_workers)]:
        least = 1 if field.endswith("batch_size") else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"stateful_dataloader({field}={value!r}) must be an integer >= {least}")
    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise ValueError("stateful_dataloader shards with its own sampler; do not pass sampler or batch_sampler")
    rank, world_size = _rank_world(rank, world_size)
    if global_batch_size is not None:
        if global_batch_size % world_size:
            raise ValueError(
                f"stateful_dataloader(global_batch_size={global_batch_size}) does not divide among "
                f"world_size={world_size} ranks; choose a global batch that every world size of the job "
                "divides (for num_slices=(min, max): each count in the range x workers per slice), or pass "
                "batch_size= to keep the per-rank batch instead")
        batch_size = global_batch_size // world_size
    return ShardedStatefulDataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
        rank=rank, world_size=world_size, global_batch_size=global_batch_size, num_workers=num_workers, **kwargs,
    )


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"stateful_dataloader needs both rank and world_size, or neither (taken from the "
            f"process group); got rank={rank!r}, world_size={world_size!r}"
        )
    shard = data_parallel_shard()
    if rank is None:
        rank, world_size = shard if shard is not None else _detected_rank_world()
    elif shard is not None and (rank, world_size) != shard:
        raise ValueError(
            f"stateful_dataloader(rank={rank!r}, world_size={world_size!r}) contradicts the job's device "
            f"mesh: this process is data-parallel rank {shard[0]} of {shard[1]}, and the loader shards by "
            "data-parallel ranks only (tensor-parallel peers must read the same batch); leave rank and "
            f"world_size out, or pass rank={shard[0]}, world_size={shard[1]}"
        )
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
