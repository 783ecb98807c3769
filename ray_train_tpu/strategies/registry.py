"""`get_strategy`: a strategy from its name, or the strategy object itself.

Strategies register themselves (`Strategy.__init_subclass__`); `load_all`
imports every module of `ray_train_tpu.strategies`, so that a strategy in a new
file is known by name without editing a list.

Example:
    >>> get_strategy("fsdp2").name
    'fsdp2'
    >>> get_strategy("zero3")
    Traceback (most recent call last):
    ...
    ValueError: strategy 'zero3' is not known; valid: ddp, fsdp2, tp, fsdp2+tp, model_parallel (or a Strategy object such as FSDP2Strategy(mp_policy=...))
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Union

from ray_train_tpu.strategies.base import STRATEGIES, Strategy

DEFAULT_STRATEGY = "ddp"
"""The strategy of ``TPUTorchTrainer`` and ``prepare_model`` when none is given."""
# Listed first, in this order, in messages; any other strategy follows.
_ORDER = ("ddp", "fsdp2", "tp", "fsdp2+tp", "model_parallel")


def load_all() -> dict[str, type[Strategy]]:
    """Import every strategy module (each registers its strategies); returns `STRATEGIES`."""
    package = importlib.import_module("ray_train_tpu.strategies")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    ordered = sorted(STRATEGIES, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))
    if list(STRATEGIES) != ordered:
        items = {n: STRATEGIES[n] for n in ordered}
        STRATEGIES.clear()
        STRATEGIES.update(items)
    return STRATEGIES


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
        load_all()
        raise TypeError(
            f"strategy must be a name ({', '.join(STRATEGIES)}) or a Strategy object, "
            f"got {type(spec).__name__} {spec!r}"
        )
    key = spec.strip().lower()
    if key not in STRATEGIES:  # one registered already (its module imported) needs no other
        load_all()
    if key not in STRATEGIES:
        raise ValueError(
            f"strategy {spec!r} is not known; valid: {', '.join(STRATEGIES)} "
            "(or a Strategy object such as FSDP2Strategy(mp_policy=...))"
        )
    return STRATEGIES[key]()
