"""Work done inside each Ray Train worker, as module-level functions that the
backend passes to ``worker_group.execute`` (Ray Train's pattern)."""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu.launch_env import ENV_KEYS, MEGASCALE_KEYS

logger = logging.getLogger(__name__)


def report() -> dict:
    """Where this worker is: host, slice, TPU worker id, TPU ids, and our
    variables that are already set."""
    import ray

    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids()
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "slice_name": _environ.get(C.TPU_NAME),
        "worker_id": _environ.get(C.TPU_WORKER_ID),
        "accelerator_type": _environ.get(C.TPU_ACCELERATOR_TYPE),
        "topology": _environ.get(C.TPU_TOPOLOGY),
        "tpu_ids": list(ids.get("TPU", [])),
        "gpu_ids": list(ids.get("GPU", [])),
        "simulate": _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1",
        "preset": _environ.snapshot(ENV_KEYS + MEGASCALE_KEYS),
    }


def free_port(host: str) -> int:
    """A port that is free on `host` (this worker's own address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def apply_env(env: dict, mode: str) -> None:
    """Set the worker's environment, then make sure the device is what it says."""
    _environ.update(env)
    if mode == "simulate":
        from ray_train_tpu import _ray_adapter

        _ray_adapter.use_cpu_device_manager()
    else:
        check_tpu_runtime()


def check_tpu_runtime() -> None:
    """Load torch_tpu and fail, naming what is missing, unless it gave us a "tpu"
    device and the "tpu_dist" backend. Never falls back to CPU."""
    import torch
    import torch.distributed as dist

    try:
        from ray.air._internal.device_manager import register_custom_torch_dist_backend

        register_custom_torch_dist_backend("tpu_dist")  # torch_tpu._loader.load()
    except ImportError:
        raise RuntimeError(
            "this worker holds a TPU but torch_tpu is not installed: install "
            "'ray_train_tpu[tpu]' (torch-tpu, libtpu) on every TPU host, or set "
            f"{C.RAY_TRAIN_TPU_SIMULATE}=1 to simulate the slice on CPU"
        ) from None
    missing = []
    if torch._C._get_privateuse1_backend_name() != "tpu":
        missing.append('"tpu" device')
    if "tpu_dist" not in dist.Backend.backend_list:
        missing.append('"tpu_dist" process-group backend')
    if missing:
        raise RuntimeError(
            f"torch_tpu is installed but registered no {' and no '.join(missing)} in "
            f"this worker; likely causes: {'; '.join(_tpu_diagnosis())}. ray_train_tpu "
            f"never falls back to CPU on a TPU host; set {C.RAY_TRAIN_TPU_SIMULATE}=1 "
            "to simulate on purpose"
        )


def _tpu_diagnosis() -> list[str]:
    causes = []
    try:
        from torch_tpu._internal.utils import hardware

        chips = hardware.get_tpu_device_count()
    except Exception:  # diagnosis only; the error above is what matters
        chips = None
    if chips == 0:
        causes.append("no TPU chip is visible to this process (no TPU PCI device under /dev/vfio or /dev/accel*)")
    holder = _lockfile_holder()
    if holder:
        causes.append(f"libtpu's lockfile {C.LIBTPU_LOCKFILE} is held by {holder}; stop that process")
    if not _environ.get(C.TORCH_TPU_SLICEBUILDER_ADDRESSES):
        causes.append(f"{C.TORCH_TPU_SLICEBUILDER_ADDRESSES} was not applied to this worker")
    if _environ.get(C.TORCH_DEVICE_BACKEND_AUTOLOAD) == "0":
        causes.append(f"{C.TORCH_DEVICE_BACKEND_AUTOLOAD}=0 is set; unset it on TPU hosts")
    return causes or ["torch_tpu failed to initialise libtpu (see the worker log)"]


def _lockfile_holder() -> str | None:
    """Who holds libtpu's lockfile, if anyone else does."""
    import fcntl

    try:
        fd = os.open(C.LIBTPU_LOCKFILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return "another process"
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


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


def set_strategy_context(strategy, topology: str, accelerator_type: str, num_slices: int) -> None:
    """Tell `prepare_model` (ours and Ray's) the job's strategy and slice."""
    from ray_train_tpu import _ray_adapter
    from ray_train_tpu import prepare

    prepare.set_context(
        prepare.StrategyContext(
            strategy=strategy or "ddp", topology=topology, accelerator_type=accelerator_type, num_slices=num_slices
        )
    )
    _ray_adapter.route_ray_prepare_model(prepare._ray_prepare_model)
