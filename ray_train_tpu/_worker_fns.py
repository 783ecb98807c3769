"""Work done inside each Ray Train worker, as module-level functions that the
backend passes to ``worker_group.execute`` (Ray Train's pattern).

They import nothing above them: constants, the environment, the Ray/torch
seams in `_compat`, the device check and the typed report of `discovery`.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Optional, Union

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._host import free_port  # noqa: F401  (run in a worker: a port free on its host)
from ray_train_tpu.discovery import Mode, WorkerReport
from ray_train_tpu.launch_env import ENV_KEYS, MEGASCALE_KEYS

logger = logging.getLogger(__name__)


def report() -> WorkerReport:
    """Where this worker is: host, slice, TPU worker id, TPU ids, and our
    variables that are already set."""
    import ray

    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids()
    node_ip = ray.util.get_node_ip_address()
    return WorkerReport(
        node_ip=node_ip,
        node_id=ctx.get_node_id(),
        slice_name=_environ.get(C.TPU_NAME),
        tpu_worker_id=_tpu_worker_id(node_ip),
        accelerator_type=_environ.get(C.TPU_ACCELERATOR_TYPE),
        topology=_environ.get(C.TPU_TOPOLOGY),
        tpu_ids=tuple(int(t) for t in ids.get("TPU", [])),
        gpu_ids=tuple(int(g) for g in ids.get("GPU", [])),
        mode=Mode.SIMULATE if _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1" else Mode.TPU,
        preset=_environ.snapshot(ENV_KEYS + MEGASCALE_KEYS),
        chip_coords=chip_coords() if ids.get("TPU") else None,
    )


_COORDS: dict = {}  # this worker's answer, asked once (a PJRT start-up on real TPUs)


def chip_coords() -> Optional[tuple[int, int, int]]:
    """Physical (X, Y, Z) of this worker's TPU chip in the slice's mesh, or None.

    On real TPUs, torch_tpu's own query (`_compat.torch_tpu.local_chip_coords`);
    on a simulated host, the host's ``RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS``
    ("x,y,z" of its first chip; `simulated_tpu_cluster(host_coords=...)` sets
    it), read only when ``RAY_TRAIN_TPU_SIMULATE=1``.
    """
    if "value" not in _COORDS:
        if _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1":
            _COORDS["value"] = _simulated_coords(_environ.get(C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS))
        else:
            from ray_train_tpu._compat import torch_tpu as compat_torch_tpu

            found = compat_torch_tpu.local_chip_coords()
            if found is None:
                return None  # not cached: a later attempt may ask again
            _COORDS["value"] = found
    return _COORDS["value"]


def _simulated_coords(raw: Optional[str]) -> Optional[tuple[int, int, int]]:
    if raw is None:
        return None
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"{C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS}={raw!r} is not three non-negative integers "
            "'x,y,z'; give simulated_tpu_cluster(host_coords={(slice_id, worker_id): (x, y, z)})"
        )
    x, y, z = (int(p) for p in parts)
    return (x, y, z)


def host_identity() -> tuple[Optional[str], Optional[str], Optional[tuple[int, int, int]]]:
    """Runs on a worker for Ray Train's worker sort (`_compat.ray_train.sort_tpu_workers`):
    its host's TPU_NAME, TPU_WORKER_ID (as set, unparsed) and chip coordinates."""
    return _environ.get(C.TPU_NAME), _environ.get(C.TPU_WORKER_ID), chip_coords()


def _tpu_worker_id(node_ip: str):
    raw = _environ.get(C.TPU_WORKER_ID)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{C.TPU_WORKER_ID}={raw!r} on host {node_ip} is not an integer; set it to the "
            "host's index in its slice (0..hosts-1), as GKE's TPU webhook does"
        ) from None


def apply_env(env: dict, mode: Union[Mode, str], unset: tuple = ()) -> None:
    """Set the worker's environment (and remove the job variables in `unset`),
    then make sure the device is what it says."""
    _environ.unset(unset)
    _environ.update(env)
    if Mode(mode) is Mode.SIMULATE:
        from ray_train_tpu._compat import ray_train as compat_ray

        compat_ray.use_cpu_device_manager()
    else:
        from ray_train_tpu.device import check_tpu_runtime

        check_tpu_runtime()


def arrive() -> None:
    """Answer the backend's roll call before the rendezvous."""
    stall = _environ.get(C.RAY_TRAIN_TPU_SIMULATE_STALL_S)
    if stall and _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1":
        time.sleep(float(stall))  # a simulated host that never joins


def join_process_group(backend: str, world_rank: int, world_size: int, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=world_rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def collective_progress() -> dict:
    """For the backend's hang watch (`ray_train_tpu.hang`): how many collectives
    this worker issued in each of its process groups, {name: (ranks, count)}.
    Runs on the actor's own thread while the training thread may be blocked."""
    from ray_train_tpu._compat import torch as compat_torch

    return compat_torch.collective_sequence_numbers()
