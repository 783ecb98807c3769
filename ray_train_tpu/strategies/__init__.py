"""Parallelism strategies, one file each behind `get_strategy`.

- ``"ddp"`` `DDPStrategy` (default): replicate, average gradients.
- ``"fsdp2"`` `FSDP2Strategy`: ``fully_shard`` inside a slice, HSDP across slices.
- ``"tp"`` `TensorParallelStrategy`: DTensor tensor parallelism on one host.
- ``"fsdp2+tp"`` `FSDP2TPStrategy`: tensor parallel inside a host, FSDP2 across.
- ``"model_parallel"`` `ModelParallelStrategy`: the user's ``parallelize_fn(model, mesh)``.

Example:
    >>> from ray_train_tpu.strategies import get_strategy
    >>> get_strategy("ddp").validate(None, num_slices=1, world_size=2).dim_names
    ('dp_replicate', 'dp_shard', 'tp')
"""

from ray_train_tpu.strategies.base import Strategy
from ray_train_tpu.strategies.ddp import DDPStrategy
from ray_train_tpu.strategies.fsdp2 import FSDP2Strategy
from ray_train_tpu.strategies.fsdp2_tp import FSDP2TPStrategy
from ray_train_tpu.strategies.model_parallel import ModelParallelStrategy
from ray_train_tpu.strategies.registry import DEFAULT_STRATEGY, STRATEGIES, get_strategy
from ray_train_tpu.strategies.tensor_parallel import TensorParallelStrategy

__all__ = [
    "DEFAULT_STRATEGY",
    "DDPStrategy",
    "FSDP2Strategy",
    "FSDP2TPStrategy",
    "ModelParallelStrategy",
    "STRATEGIES",
    "Strategy",
    "TensorParallelStrategy",
    "get_strategy",
]
