"""`prepare_model()`: move a model to the worker's device and apply the strategy.

Inside `TPUTorchTrainer` the strategy is the trainer's (``strategy="fsdp2"``
...); Ray's own ``ray.train.torch.prepare_model`` is routed here as well, with
``parallel_strategy="ddp"`` meaning the trainer's strategy (DDP by default) and
``"fsdp"`` meaning FSDP2 (``fully_shard``), since FSDP1 needs CUDA.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from ray_train_tpu.device import get_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StrategyContext:
    """What a worker knows about the job's parallelism, set by the backend."""

    strategy: Any  # a ray_train_tpu.strategies Strategy
    topology: Optional[str] = None
    accelerator_type: Optional[str] = None
    num_slices: int = 1


_context: Optional[StrategyContext] = None


def set_context(context: Optional[StrategyContext]) -> None:
    global _context
    _context = context


def get_context() -> Optional[StrategyContext]:
    return _context


def prepare_model(model, *, strategy: Any = None, move_to_device: bool = True):
    """Move `model` to `get_device()` and parallelise it with the strategy.

    Args:
        model: a ``torch.nn.Module`` built on CPU (or on the meta device for FSDP2).
        strategy: ``"ddp"``, ``"fsdp2"``, ``"tp"``, ``"fsdp2+tp"`` or a strategy
            object; default: the trainer's strategy, else DDP.
        move_to_device: move the model to the worker's device first.

    Example:
        >>> model = ray_train_tpu.prepare_model(torch.nn.Linear(4, 2))  # doctest: +SKIP
    """
    import torch.distributed as dist

    from ray_train_tpu.strategies import get_strategy
    from ray_train_tpu.strategies.base import to_device
    from ray_train_tpu.topology import Topology

    chosen = get_strategy(strategy) if strategy is not None else current_strategy()
    ctx = _context or StrategyContext(strategy=chosen)
    device = get_device()
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    topology = Topology.parse(ctx.topology, ctx.accelerator_type) if ctx.topology else None
    chosen.setup(device, world_size, topology, ctx.num_slices)
    if move_to_device:
        model = to_device(model, device)
    return chosen.parallelize(model, device)


def set_worker_context(strategy, topology: str, accelerator_type: str, num_slices: int) -> None:
    """Runs in each worker (the backend passes it to ``worker_group.execute``):
    tell `prepare_model`, ours and Ray's, the job's strategy and slice."""
    from ray_train_tpu._compat import ray_train as compat_ray

    set_context(
        StrategyContext(
            strategy=strategy or "ddp", topology=topology, accelerator_type=accelerator_type, num_slices=num_slices
        )
    )
    compat_ray.route_ray_prepare(ray_prepare_model, data_parallel_shard)


def ray_prepare_model(model, move_to_device=True, parallel_strategy="ddp", parallel_strategy_kwargs=None):
    """``ray.train.torch.prepare_model`` inside a TPUTorchTrainer worker."""
    if parallel_strategy_kwargs:
        logger.warning(
            "ray_train_tpu: ignoring ray.train.torch.prepare_model(parallel_strategy_kwargs=%r); "
            "configure the strategy object passed to TPUTorchTrainer(strategy=...) instead",
            parallel_strategy_kwargs,
        )
    if parallel_strategy is None:
        from ray_train_tpu.strategies.base import to_device

        return to_device(model, get_device()) if move_to_device else model
    if parallel_strategy == "fsdp":
        return prepare_model(model, strategy="fsdp2", move_to_device=bool(move_to_device))
    if parallel_strategy != "ddp":
        raise ValueError(
            f"ray.train.torch.prepare_model(parallel_strategy={parallel_strategy!r}) must be "
            "'ddp', 'fsdp' or None"
        )
    return prepare_model(model, move_to_device=bool(move_to_device))


def current_strategy():
    """The strategy object of this worker (after `prepare_model`, with its mesh):
    e.g. ``current_strategy().distributed_sampler_kwargs`` shards data by the
    data-parallel ranks only, so tensor-parallel peers read the same batch."""
    from ray_train_tpu.strategies import get_strategy

    ctx = _context or StrategyContext(strategy="ddp")
    strategy = get_strategy(ctx.strategy)
    if ctx.strategy is not strategy:
        set_context(dataclasses.replace(ctx, strategy=strategy))
    return strategy


def data_parallel_shard() -> Optional[tuple[int, int]]:
    """``(dp_rank, dp_size)`` of this rank in the job's mesh, or ``None`` where no
    mesh is known (no process group, or neither a strategy's ``setup`` nor a
    TPUTorchTrainer worker context in this process).

    Tensor-parallel peers get the same ``dp_rank``, so a sampler built with it
    hands them the same batch. The mesh is the one the last ``Strategy.setup``
    built here (`ray_train_tpu.strategies.base.active_strategy`); before
    `prepare_model`, inside a ``TPUTorchTrainer``, it is the layout of the
    trainer's strategy, the same one ``prepare_model`` will build.
    """
    import torch.distributed as dist

    from ray_train_tpu.strategies.base import active_strategy

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    active = active_strategy()
    layout = active.mesh_layout if active is not None else None
    if layout is None or layout.world_size != world_size:
        if _context is None:
            return None
        from ray_train_tpu.topology import Topology

        ctx = _context
        topology = Topology.parse(ctx.topology, ctx.accelerator_type) if ctx.topology else None
        layout = current_strategy().validate(topology, ctx.num_slices, world_size)
    return layout.data_parallel(rank)
