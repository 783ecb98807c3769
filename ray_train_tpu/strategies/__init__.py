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

from ray_train_tpu.strategies.base import STRATEGIES as _registered
from ray_train_tpu.strategies.base import Strategy
from ray_train_tpu.strategies.registry import DEFAULT_STRATEGY, get_strategy, load_all

# The strategy classes (and the full ``STRATEGIES``) are looked up on first use, not
# imported with the package: every Ray Train worker imports this package when it
# unpickles its trainer's strategy, and FSDP2's and tensor parallelism's modules import
# torch's DTensor and FSDP (with sympy, ~0.65 s of CPU per worker) that DDP never uses.
_NAMES = ("DEFAULT_STRATEGY", "STRATEGIES", "Strategy", "get_strategy")


def __getattr__(name: str):
    if name == "STRATEGIES":
        return load_all()
    if name == "__all__":
        return sorted([*_NAMES, *(cls.__name__ for cls in load_all().values())])
    if not name.startswith("__"):  # pickle, inspect and copy ask for dunders: never a strategy
        cls = _class_named(name, _registered) or _class_named(name, load_all())
        if cls is not None:
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _class_named(name: str, strategies: dict):
    return next((cls for cls in strategies.values() if cls.__name__ == name), None)


def __dir__():
    return sorted(set(globals()) | set(__getattr__("__all__")))
