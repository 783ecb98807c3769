"""`TensorParallelStrategy`: split layers across the ranks of one host with DTensor.

The model is parallelized with torch's ``parallelize_module`` and a plan the
user writes, ``{submodule fqn: ColwiseParallel() | RowwiseParallel() | ...}``,
or by the user's own ``parallelize_fn(model, tp_mesh)``. Every rank of a
tensor-parallel group reads the same batch.

This strategy is tensor parallelism alone (``tp_size`` = world size, one host);
to add data parallelism across hosts use `FSDP2TPStrategy`, which averages the
gradients of the replicas.

Example:
    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    >>> s = TensorParallelStrategy(plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    >>> s.validate(None, num_slices=1, world_size=4).shape
    (1, 1, 4)
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ray_train_tpu import _validate as V
from ray_train_tpu.mesh import MeshLayout
from ray_train_tpu.strategies.base import Strategy, standard_layout, to_device

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ray_train_tpu.topology import Topology

ParallelizeFn = Callable[[nn.Module, "DeviceMesh"], nn.Module]

_PLAN_EXAMPLE = (
    "plan={'0': ColwiseParallel(), '2': RowwiseParallel()} (submodule names from "
    "model.named_modules(), styles from torch.distributed.tensor.parallel) or "
    "parallelize_fn=fn(model, tp_mesh) -> model"
)


def check_tp_plan(
    cls: str, plan: Optional[Mapping[str, ParallelStyle]], parallelize_fn: Optional[ParallelizeFn]
) -> None:
    """Exactly one of `plan` and `parallelize_fn`, each of the right type."""
    if (plan is None) == (parallelize_fn is None):
        got = "both" if plan is not None else "neither"
        raise ValueError(f"{cls} needs exactly one of {_PLAN_EXAMPLE}; got {got}")
    if parallelize_fn is not None and not callable(parallelize_fn):
        raise TypeError(f"{cls}(parallelize_fn={parallelize_fn!r}) must be callable as fn(model, tp_mesh)")
    if plan is not None:
        if not isinstance(plan, Mapping) or not plan:
            raise ValueError(f"{cls}(plan={plan!r}) must be a non-empty dict, e.g. {_PLAN_EXAMPLE}")
        bad = {k: v for k, v in plan.items() if not isinstance(k, str) or not isinstance(v, ParallelStyle)}
        if bad:
            raise TypeError(
                f"{cls}(plan=...) maps submodule names (str) to ParallelStyle objects; "
                f"wrong entries: {bad!r}; e.g. {_PLAN_EXAMPLE}"
            )


def check_tp_size(cls: str, tp_size: Optional[int]) -> None:
    if tp_size is not None:
        V.check_int(cls, "tp_size", tp_size, min=1, fix="or None for every device of a host")


def _plan_key_matches(key: str, name: str) -> bool:
    """Does plan key `key` (an FQN, or a pattern such as ``layers.*.attention``
    as ``parallelize_module`` accepts: fnmatch per dot-separated atom) name the
    submodule `name`?

    Example:
        >>> _plan_key_matches("layers.*.attention", "layers.3.attention")
        True
        >>> _plan_key_matches("layers.*", "layers.3.attention")
        False
    """
    atoms, parts = key.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def apply_tp(
    model: nn.Module,
    tp_mesh: "DeviceMesh",
    plan: Optional[Mapping[str, ParallelStyle]],
    parallelize_fn: Optional[ParallelizeFn],
) -> nn.Module:
    """``parallelize_module(model, tp_mesh, plan)``, or the user's function."""
    if plan is not None:
        names = [name for name, _ in model.named_modules() if name]
        missing = sorted(key for key in plan if not any(_plan_key_matches(key, n) for n in names))
        if missing:
            # parallelize_module only warns about these; a typo would leave the layer whole.
            raise ValueError(
                f"tensor-parallel plan names submodules the model does not have: {missing}; "
                f"use names from model.named_modules() or fnmatch patterns of them such as "
                f"'layers.*.attention', e.g. {names[:6]}"
            )
        return parallelize_module(model, tp_mesh, dict(plan))
    out = parallelize_fn(model, tp_mesh)
    if not isinstance(out, nn.Module):
        raise TypeError(
            f"parallelize_fn must return the parallelized nn.Module, got {type(out).__name__}; "
            "end it with `return model`"
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallelStrategy(Strategy):
    """Tensor parallelism over all ranks (one host), with torch's ``parallelize_module``.

    Args:
        plan: ``{submodule fqn: ParallelStyle}`` for ``parallelize_module``.
        parallelize_fn: instead of `plan`, ``fn(model, tp_mesh) -> model``.
        tp_size: ``None`` for the world size; any other value must equal it.

    Example:
        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> TensorParallelStrategy()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: TensorParallelStrategy needs exactly one of plan={'0': ColwiseParallel(), ...; got neither
    """

    name = "tp"
    plan: Optional[Mapping[str, ParallelStyle]] = None
    parallelize_fn: Optional[ParallelizeFn] = None
    tp_size: Optional[int] = None

    def __post_init__(self):
        check_tp_plan(type(self).__name__, self.plan, self.parallelize_fn)
        check_tp_size(type(self).__name__, self.tp_size)

    def _layout(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        tp_size = world_size if self.tp_size is None else self.tp_size
        layout = standard_layout(topology, num_slices, world_size, tp_size=tp_size, fsdp=False)
        replicas = layout.size("dp_replicate")
        if replicas > 1:
            raise ValueError(
                f"TensorParallelStrategy(tp_size={tp_size}) leaves {replicas} data-parallel "
                f"replicas of the {world_size} ranks, and this strategy does not average their "
                "gradients; use FSDP2TPStrategy(tp_size=..., plan=...) (get_strategy('fsdp2+tp')) "
                "to combine tensor and data parallelism"
            )
        return layout

    def parallelize(self, model: nn.Module, device: "torch.device") -> nn.Module:
        """`model` on `device`, its planned layers split over the ``tp`` mesh dimension."""
        model = to_device(model, device)
        return apply_tp(model, self.device_mesh["tp"], self.plan, self.parallelize_fn)
