"""`FSDP2Strategy`: shard parameters, gradients and optimizer state with ``fully_shard``.

Parameters are sharded over ``dp_shard`` (the ranks of one slice) and, with
several slices, replicated over ``dp_replicate`` (HSDP), so that only gradient
all-reduces cross DCN. Mixed precision is torch's own frozen
``MixedPrecisionPolicy``; the sharded parameters the optimizer updates stay in
their original dtype (fp32 master weights).

Example:
    >>> import torch
    >>> from torch.distributed.fsdp import MixedPrecisionPolicy
    >>> s = FSDP2Strategy(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    >>> s.validate(None, num_slices=2, world_size=8).shape
    (2, 4, 1)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ray_train_tpu.mesh import MeshLayout
from ray_train_tpu.strategies.base import Strategy, dp_mesh, standard_layout, to_device

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ray_train_tpu.topology import Topology

ShardModules = Union[None, Callable[[nn.Module], bool], Sequence[type]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2Strategy(Strategy):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) on the data-parallel mesh.

    Args:
        mp_policy: torch's ``MixedPrecisionPolicy``, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
        reshard_after_forward: as in ``fully_shard``; ``None`` is torch's default
            (reshard every module but the root).
        shard_modules: which submodules get their own ``fully_shard`` (one
            all-gather each) before the root: a predicate ``fn(module) -> bool``
            or module classes (e.g. ``[TransformerBlock]``). Default: every direct
            child that has parameters.

    Example:
        >>> s = FSDP2Strategy(shard_modules=[nn.Linear])
        >>> model = s.parallelize(model, device)  # after s.setup(...)  # doctest: +SKIP
    """

    name = "fsdp2"
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    reshard_after_forward: Optional[Union[bool, int]] = None
    shard_modules: ShardModules = None

    def __post_init__(self):
        cls = type(self).__name__
        if not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"{cls}(mp_policy={self.mp_policy!r}) must be a torch.distributed.fsdp."
                "MixedPrecisionPolicy, e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
            )
        raf = self.reshard_after_forward
        if raf is not None and not isinstance(raf, (bool, int)):
            raise TypeError(f"{cls}(reshard_after_forward={raf!r}) must be None, a bool or an int")
        sm = self.shard_modules
        if sm is None or (callable(sm) and not isinstance(sm, type)):
            return
        if isinstance(sm, type):
            sm = (sm,)
        if isinstance(sm, str) or not isinstance(sm, Sequence) or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in sm
        ):
            raise TypeError(
                f"{cls}(shard_modules={self.shard_modules!r}) must be None, a predicate "
                "fn(module) -> bool, or nn.Module classes such as [TransformerBlock]"
            )
        object.__setattr__(self, "shard_modules", tuple(sm))  # frozen: a tuple, not the caller's list

    def _layout(self, topology: Optional["Topology"], num_slices: int, world_size: int) -> MeshLayout:
        return standard_layout(topology, num_slices, world_size, tp_size=1, fsdp=True)

    def parallelize(self, model: nn.Module, device: "torch.device") -> nn.Module:
        """`model` on `device`, sharded with ``fully_shard`` (in place; returned)."""
        model = to_device(model, device)
        return apply_fsdp(model, dp_mesh(self.device_mesh), self)


def _wanted(shard_modules: ShardModules) -> Callable[[str, nn.Module], bool]:
    if shard_modules is None:
        # Direct children only: their names have no dot.
        return lambda name, m: "." not in name and any(True for _ in m.parameters())
    if isinstance(shard_modules, tuple):
        return lambda name, m: isinstance(m, shard_modules)
    return lambda name, m: bool(shard_modules(m))


def apply_fsdp(model: nn.Module, mesh: "DeviceMesh", strategy: FSDP2Strategy) -> nn.Module:
    """``fully_shard`` the chosen submodules, innermost first, then the root.

    Innermost first because ``fully_shard`` of a parent manages every parameter
    not already managed by a sharded child.
    """
    wanted = _wanted(strategy.shard_modules)
    chosen = [m for name, m in model.named_modules() if name and wanted(name, m)]
    kwargs = dict(mesh=mesh, mp_policy=strategy.mp_policy, reshard_after_forward=strategy.reshard_after_forward)
    for module in reversed(chosen):  # named_modules is pre-order: reversed puts children first
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model
