"""Collectives a checkpoint needs, that also work without a process group (one process)."""

from __future__ import annotations

def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _barrier() -> None:
    if _dist():
        _dist().barrier()


def _broadcast(obj):
    box = [obj]
    if _dist():
        _dist().broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    out = [obj] * _rank_world()[1]
    if _dist():
        _dist().all_gather_object(out, obj)
    return out


_ASYNC_GROUP: dict = {}


def _async_group():
    """A gloo group for background saves only: no collective interleaves with training's."""
    dist = _dist()
    if dist and id(dist.group.WORLD) not in _ASYNC_GROUP:
        _ASYNC_GROUP.clear()
        _ASYNC_GROUP[id(dist.group.WORLD)] = dist.new_group(backend="gloo")
    return _ASYNC_GROUP[id(dist.group.WORLD)] if dist else None
