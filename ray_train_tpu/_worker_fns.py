"""Work done inside each Ray Train worker, as module-level functions that the
backend passes to ``worker_group.execute`` (Ray Train's pattern).

They import nothing above them: constants, the environment, the Ray/torch
seams in `_compat`, the device check and the typed report of `discovery`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Union

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._host import free_port  # noqa: F401  (run in a worker: a port free on its host)
from ray_train_tpu.discovery import HostIdentity, Mode, WorkerReport
from ray_train_tpu.discovery import host_identity as resolve_host_identity
from ray_train_tpu.launch_env import ENV_KEYS, MEGASCALE_KEYS

logger = logging.getLogger(__name__)


def report() -> WorkerReport:
    """Where this worker is: host, slice, TPU worker id, TPU ids, and our
    variables that are already set."""
    import ray

    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids()
    node_ip = ray.util.get_node_ip_address()
    identity = this_host()
    return WorkerReport(
        node_ip=node_ip,
        node_id=ctx.get_node_id(),
        slice_name=identity.slice_name,
        tpu_worker_id=_tpu_worker_id(node_ip, identity),
        accelerator_type=identity.pod_type,
        topology=identity.topology,
        tpu_ids=tuple(int(t) for t in ids.get("TPU", [])),
        gpu_ids=tuple(int(g) for g in ids.get("GPU", [])),
        mode=Mode.SIMULATE if _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1" else Mode.TPU,
        preset=_environ.snapshot(ENV_KEYS + MEGASCALE_KEYS),
        chip_coords=host_chip_coords() if ids.get("TPU") else None,
    )


_HOST_COORDS: dict = {}  # this host's answer, in the worker that asked (or read it)
# The worker holding this Ray TPU id asks for its host; the others report None.
_ASKING_TPU_ID = "0"
SIMULATED_LIBTPU_MODULE = "ray_train_tpu.testing.simulated_libtpu"


def host_chip_coords() -> Optional[tuple[int, int, int]]:
    """Physical (X, Y, Z) of the first chip of this worker's host, or None.

    One worker per host asks (the one holding Ray's TPU id 0, so every host of
    a whole slice asks at once, as a multi-host bring-up needs), and only on a
    multi-host slice (one host has nothing to order): torch_tpu's own query
    (`_compat.torch_tpu.query_chip_coords`) in one child process, before any
    worker has started PJRT, with the whole host's view of libtpu
    (`launch_env.coords_query_env`), not this worker's one-chip view from Ray.
    On a simulated host, the same child path runs
    `ray_train_tpu.testing.simulated_libtpu` instead. The answer, or the
    failure, is kept for the Ray node: asked once per host, whatever the
    attempts and workers that follow. The other workers report None.
    """
    import ray

    ids = [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("TPU", [])]
    topology = _host_topology()
    if _ASKING_TPU_ID not in ids or topology is None or not topology.is_multi_host:
        return None
    record = host_coords_record(topology)
    return None if record["coords"] is None else tuple(record["coords"])


def host_coords_record(topology=None) -> Optional[dict]:
    """This host's coordinate answer ({"coords", "error", "seconds"}): asked now
    if `topology` is given and nobody asked on this Ray node yet; else None."""
    import ray

    if "record" in _HOST_COORDS:
        return _HOST_COORDS["record"]
    path = _record_path(ray.get_runtime_context().get_node_id())
    try:
        _HOST_COORDS["record"] = json.loads(path.read_text())
        return _HOST_COORDS["record"]
    except (OSError, ValueError):
        if topology is None:
            return None
    from ray_train_tpu._compat import torch_tpu as compat_torch_tpu
    from ray_train_tpu.launch_env import coords_query_env

    simulated = _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"
    argv = [sys.executable, "-m", SIMULATED_LIBTPU_MODULE] if simulated else None
    answer = compat_torch_tpu.query_chip_coords(coords_query_env(_environ.copy(), topology), argv=argv)
    record = {"coords": None if answer.coords is None else list(answer.coords), "error": answer.error,
              "seconds": answer.seconds}
    if answer.error:
        logger.warning(
            "ray_train_tpu: host %s: no TPU chip coordinates after %.1f s (%s)%s; its slice keeps "
            "TPU_WORKER_ID order unless every host has them. Not asked again on this host (Ray node %s).",
            ray.util.get_node_ip_address(), answer.seconds, answer.error, " [SIMULATED]" if simulated else "",
            path.stem,
        )
    _write_record(path, record)
    _HOST_COORDS["record"] = record
    return record


def _record_path(node_id: str) -> Path:
    return Path(tempfile.gettempdir(), "ray_train_tpu", "chip_coords", f"{node_id}.json")


def _write_record(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record))
        partial.replace(path)  # whole or not at all: another worker may read it now
    except OSError as e:  # only the cache is lost: this process keeps its answer
        logger.warning("ray_train_tpu: could not keep this host's chip coordinates in %s: %s", path, e)


_WARNED: set = set()  # conflicts this process has logged


def this_host() -> HostIdentity:
    """This worker's host: slice name, TPU worker id, topology and pod type,
    from GKE's variables where set, else from Ray's node labels (on a TPU VM
    started with ``ray start``, Ray reads them from the GCE metadata server).
    Where both are set and disagree, the variable wins and a warning names
    both, once per process (`discovery.host_identity`; docs/environment.md).
    In a process not connected to Ray (vLLM's engine-core process; a direct
    call), the variables alone: asking Ray's runtime context would connect."""
    import ray

    labels = dict(ray.get_runtime_context().get_node_labels() or {}) if ray.is_initialized() else {}
    identity = resolve_host_identity(_environ.copy(), labels)
    for conflict in identity.conflicts:
        if conflict not in _WARNED:
            _WARNED.add(conflict)
            logger.warning("ray_train_tpu: host %s: %s (docs/environment.md; `ray-train-tpu doctor` "
                           "reports it as env_label_mismatch)", ray.util.get_node_ip_address(), conflict)
    return identity


def _host_topology():
    """The host's slice from its topology and pod type (`this_host`); None if unknown."""
    from ray_train_tpu.topology import Topology, generation_of_pod_type

    identity = this_host()
    name, pod_type = identity.topology, identity.pod_type
    try:
        return Topology.parse(name, generation_of_pod_type(pod_type)) if name and pod_type else None
    except ValueError:
        return None


def host_identity() -> tuple[Optional[str], Optional[str], Optional[tuple[int, int, int]]]:
    """Runs on a worker for Ray Train's worker sort (`_compat.ray_train.sort_tpu_workers`):
    its host's slice name, TPU worker id (unparsed; `this_host`: TPU_NAME and
    TPU_WORKER_ID, else Ray's node labels) and, from the one worker per host
    that asks, the host's chip coordinates (`host_chip_coords`)."""
    identity = this_host()
    return identity.slice_name, identity.worker_id, host_chip_coords()


def _tpu_worker_id(node_ip: str, identity: HostIdentity):
    raw = identity.worker_id
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        source = identity.sources.get("worker_id", C.TPU_WORKER_ID)
        raise ValueError(
            f"{source}={raw!r} on host {node_ip} is not an integer; set it to the "
            "host's index in its slice (0..hosts-1), as GKE's TPU webhook does"
        ) from None


def apply_env(env: dict, mode: Union[Mode, str], unset: tuple = ()) -> None:
    """Set the worker's environment (and remove the job variables in `unset`),
    then make sure the device is what it says."""
    _environ.unset(unset)
    _environ.update(env)
    if Mode(mode) is Mode.SIMULATE:
        from ray_train_tpu._compat import ray_train as compat_ray
        from ray_train_tpu.device import describe_simulated_chip, simulated_device_kind

        compat_ray.use_simulated_tpu_device_manager(host=simulated_device_kind() == "host")
        describe_simulated_chip()
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
    if backend == "tpu_dist":  # dist.barrier(device_ids=[LOCAL_RANK]) means this process's one device: [0]
        from ray_train_tpu._compat import torch as compat_torch

        compat_torch.carry_barrier_device_ids(int(_environ.get(C.LOCAL_RANK) or 0))


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def start_progress_probes() -> None:
    """For the backend's hang watch (`ray_train_tpu.hang`): count this worker's
    collective entries and optimizer steps from now on (before training starts)."""
    from ray_train_tpu import hang

    hang.install_worker_probes()


def collective_progress() -> dict:
    """For the backend's hang watch (`ray_train_tpu.hang`): this worker's
    collectives entered per process group, optimizer steps and training-thread
    frame (`hang.worker_progress`). Runs on the actor's own thread while the
    training thread may be blocked."""
    from ray_train_tpu import hang

    return hang.worker_progress()
