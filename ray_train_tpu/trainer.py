"""`TPUTorchTrainer`: Ray's TorchTrainer for TPU slices, plus a parallelism strategy."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Optional, Union

from ray.train import DataConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from ray_train_tpu.config import TPUTorchConfig
from ray_train_tpu.scaling import TPUScalingConfig
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)


class TPUTorchTrainer(TorchTrainer):
    """A drop-in `ray.train.torch.TorchTrainer` for TPU slices.

    Takes every argument TorchTrainer takes, with the same names and defaults,
    and `strategy`: ``"ddp"`` (default), ``"fsdp2"`` (``fully_shard``), ``"tp"``
    (DTensor tensor parallel), ``"fsdp2+tp"`` (2-D), or a strategy object from
    `ray_train_tpu.strategies` (e.g. ``ModelParallelStrategy`` with your own
    ``parallelize_fn``). Inside the training function, ``ray_train_tpu.prepare_model``
    and Ray's ``ray.train.torch.prepare_model`` apply it; ``get_device()`` gives
    ``tpu`` (``cpu`` on a simulated slice).

    The strategy's layout is checked against the slice before any worker starts.

    Example:
        >>> trainer = TPUTorchTrainer(                                # doctest: +SKIP
        ...     train_fn,
        ...     scaling_config=TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E"),
        ...     strategy="fsdp2",
        ... )
        >>> result = trainer.fit()                                    # doctest: +SKIP
    """

    def __init__(
        self,
        train_loop_per_worker: Union[Callable[[], Any], Callable[[Dict], Any]],
        *,
        train_loop_config: Optional[Dict] = None,
        torch_config: Optional[TorchConfig] = None,
        scaling_config: Optional[ScalingConfig] = None,
        run_config: Optional[RunConfig] = None,
        datasets: Optional[Dict[str, Any]] = None,
        dataset_config: Optional[DataConfig] = None,
        validation_config: Optional[Any] = None,
        metadata: Optional[Dict[str, Any]] = None,
        resume_from_checkpoint: Optional[Any] = None,
        strategy: Any = "ddp",
    ):
        from ray_train_tpu.strategies import get_strategy

        torch_config = _tpu_torch_config(torch_config, scaling_config)
        chosen = get_strategy(strategy)
        topology, sizes = _slice_of(scaling_config)
        for num_slices, world_size in sizes:  # an elastic job: every size it may run at
            chosen.validate(topology, num_slices, world_size)
        torch_config.strategy = chosen
        self.strategy = chosen
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            torch_config=torch_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            validation_config=validation_config,
            metadata=metadata,
            resume_from_checkpoint=resume_from_checkpoint,
        )


def _tpu_torch_config(torch_config: Optional[TorchConfig], scaling_config) -> TPUTorchConfig:
    if torch_config is None:
        kwargs = {}
        if isinstance(scaling_config, TPUScalingConfig):
            kwargs = dict(
                topology=scaling_config.topology,
                accelerator_type=scaling_config.accelerator_type,
                num_slices=scaling_config.num_slices,
            )
        return TPUTorchConfig(**kwargs)
    if isinstance(torch_config, TPUTorchConfig):
        return dataclasses.replace(torch_config)  # the trainer sets its strategy
    if isinstance(torch_config, TorchConfig):
        logger.warning(
            "ray_train_tpu: TPUTorchTrainer(torch_config=TorchConfig(...)) replaced by "
            "TPUTorchConfig(backend=%r, timeout_s=%r); pass a TPUTorchConfig to set "
            "TPU options",
            torch_config.backend,
            torch_config.timeout_s,
        )
        return TPUTorchConfig(backend=torch_config.backend, init_method=torch_config.init_method, timeout_s=torch_config.timeout_s)
    raise TypeError(
        f"TPUTorchTrainer(torch_config={torch_config!r}) must be a TPUTorchConfig or a "
        "ray.train.torch.TorchConfig"
    )


def _slice_of(scaling_config) -> tuple[Optional[Topology], list[tuple[int, int]]]:
    """The topology and the (num_slices, world size) pairs the strategy must fit:
    one, or one per slice count of an elastic range."""
    if isinstance(scaling_config, TPUScalingConfig):
        per_slice = scaling_config.workers_per_slice
        return scaling_config.tpu_topology, [
            (n, n * per_slice) for n in range(scaling_config.min_slices, scaling_config.max_slices + 1)]
    if scaling_config is None:
        return None, [(1, 1)]
    workers = scaling_config.num_workers
    low, high = (workers, workers) if isinstance(workers, int) else workers
    topology = None
    if getattr(scaling_config, "use_tpu", False) and scaling_config.topology and scaling_config.accelerator_type:
        topology = Topology.parse(scaling_config.topology, scaling_config.accelerator_type)
    if topology is None:
        return None, [(1, high)]
    per_slice = topology.num_devices
    return topology, [(max(1, n // per_slice), n) for n in range(low, high + 1, per_slice) if n >= per_slice] or [
        (max(1, high // per_slice), high)]
