"""`get_strategy`: a strategy from its name, or the strategy object itself.

Example:
    >>> get_strategy("fsdp2").name
    'fsdp2'
    >>> get_strategy("zero3")
    Traceback (most recent call last):
    ...
    ValueError: strategy 'zero3' is not known; valid: ddp, fsdp2, tp, fsdp2+tp, model_parallel (or a Strategy object such as FSDP2Strategy(mp_policy=...))
"""

from __future__ import annotations

from typing import Optional, Union

from ray_train_tpu.strategies.base import Strategy
from ray_train_tpu.strategies.ddp import DDPStrategy
from ray_train_tpu.strategies.fsdp2 import FSDP2Strategy
from ray_train_tpu.strategies.fsdp2_tp import FSDP2TPStrategy
from ray_train_tpu.strategies.model_parallel import ModelParallelStrategy
from ray_train_tpu.strategies.tensor_parallel import TensorParallelStrategy

DEFAULT_STRATEGY = "ddp"
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (DDPStrategy, FSDP2Strategy, TensorParallelStrategy, FSDP2TPStrategy, ModelParallelStrategy)
}


def get_strategy(spec: Union[str, Strategy, None] = None) -> Strategy:
    """The strategy for `spec`: a `Strategy` is returned as is; a name builds that
    strategy with its defaults (``None`` is ``"ddp"``).

    ``"tp"``, ``"fsdp2+tp"`` and ``"model_parallel"`` have no defaults for the
    plan or function they need; their error says how to give one.
    """
    if spec is None:
        spec = DEFAULT_STRATEGY
    if isinstance(spec, Strategy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"strategy must be a name ({', '.join(STRATEGIES)}) or a Strategy object, "
            f"got {type(spec).__name__} {spec!r}"
        )
    key = spec.strip().lower()
    if key not in STRATEGIES:
        raise ValueError(
            f"strategy {spec!r} is not known; valid: {', '.join(STRATEGIES)} "
            "(or a Strategy object such as FSDP2Strategy(mp_policy=...))"
        )
    return STRATEGIES[key]()
