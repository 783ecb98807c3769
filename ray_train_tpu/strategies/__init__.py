"""Parallelism strategies, one file each; each registers itself by name.

- ``"ddp"`` `DDPStrategy` (default): replicate, average gradients.
- ``"fsdp2"`` `FSDP2Strategy`: ``fully_shard`` inside a slice, HSDP across slices.
- ``"tp"`` `TensorParallelStrategy`: DTensor tensor parallelism on one host.
- ``"fsdp2+tp"`` `FSDP2TPStrategy`: tensor parallel inside a host, FSDP2 across.
- ``"model_parallel"`` `ModelParallelStrategy`: the user's ``parallelize_fn(model, mesh)``.

A new strategy is one new module here: a `Strategy` subclass with a ``name``
(see `ray_train_tpu.strategies.base`); it is then known to `get_strategy`,
``TPUTorchTrainer(strategy=...)`` and exported from this package.

Example:
    >>> from ray_train_tpu.strategies import get_strategy
    >>> get_strategy("ddp").validate(None, num_slices=1, world_size=2).dim_names
    ('dp_replicate', 'dp_shard', 'tp')
"""

from ray_train_tpu.strategies.base import Strategy
from ray_train_tpu.strategies.registry import DEFAULT_STRATEGY, STRATEGIES, get_strategy, load_all

load_all()
globals().update({cls.__name__: cls for cls in STRATEGIES.values()})

__all__ = sorted(["DEFAULT_STRATEGY", "STRATEGIES", "Strategy", "get_strategy",
                  *(cls.__name__ for cls in STRATEGIES.values())])
