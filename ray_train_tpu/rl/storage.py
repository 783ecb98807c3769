"""Where a GRPO run keeps its checkpoints, and what every host must see before
anything starts.

Checkpoints go to storage every host sees, named as Ray Train's
``RunConfig(storage_path=...)`` names it and resolved by the same helpers
(pyarrow.fs): a directory on a filesystem every host mounts (NFS, GCS FUSE), or
a URI (``gs://bucket/run``, ``s3://...``). For a URI each rank writes its files
into its own host's scratch directory, uploads them, and rank 0 uploads the
manifest last (a checkpoint without one is incomplete and skipped); to load,
each rank downloads the checkpoint into its host's scratch first.

A temporary directory on the driver (``checkpoint_dir=None``) is only allowed on
a one-node cluster: on more nodes the trainer's hosts would write to their own
disks, the driver would find no checkpoint, and a restarted trainer would begin
again at step 0 (`refuse_driver_local_default`). `check_hosts` runs one cheap
task on every trainer and engine host: the model directory must be there, and a
checkpoint directory must be the one the driver sees (a marker file the driver
wrote), with an error naming the host and the path.

Example:
    >>> join("gs://bucket/run", "step_000005"), join("/mnt/shared/run/", "step_000005")
    ('gs://bucket/run/step_000005', '/mnt/shared/run/step_000005')
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from ray_train_tpu import _environ
from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C

logger = logging.getLogger(__name__)

_MARKER = ".ray_train_tpu_shared_check-"
_FIX = ("checkpoint_dir='gs://<bucket>/<run>' (or 's3://...'), or a directory on a filesystem every host mounts "
        "(in simulation: simulated_tpu_cluster(...).storage_path)")


def join(root: str, name: str) -> str:
    return f"{str(root).rstrip('/')}/{name}"


def resolve(root: str, filesystem: Any = None) -> tuple[Any, str]:
    """``(pyarrow filesystem, path)`` of a checkpoint root, or ``(None, path)`` for
    a local (mounted) path, as Ray Train resolves a ``storage_path``."""
    if filesystem is None and "://" not in str(root):
        return None, str(root)
    import pyarrow.fs

    from ray_train_tpu._compat import ray_train as compat_ray

    fs, path = compat_ray.storage_fs_and_path(str(root), filesystem)
    return (None, path) if isinstance(fs, pyarrow.fs.LocalFileSystem) else (fs, path)


def refuse_driver_local_default(checkpoint_dir: Optional[str], num_nodes: int) -> None:
    """ValueError for the default (a temporary directory on the driver) on a
    cluster of more than one node."""
    if checkpoint_dir is None and num_nodes > 1:
        raise V.fail("GRPOConfig", "checkpoint_dir", checkpoint_dir,
                     f"storage every host sees on a cluster of {num_nodes} nodes (None means a temporary directory "
                     "on the driver, tempfile.mkdtemp(): the trainer's hosts would write to their own disks, the "
                     "driver would find no checkpoint, and a restarted trainer would begin again at step 0)", _FIX)


# --- on the trainer's ranks

def save(root: str, name: str, *, model, optimizer, step: int, filesystem: Any = None) -> None:
    """`ray_train_tpu.checkpoint.save` of every rank into ``root/name`` (call on every rank)."""
    from ray_train_tpu import checkpoint
    from ray_train_tpu.checkpoint._collective import _barrier, _rank_world

    fs, path = resolve(root, filesystem)
    if fs is None:
        checkpoint.save(Path(path) / name, model=model, optimizer=optimizer, step=step)
        return
    staging = tempfile.mkdtemp(prefix="grpo_ckpt_")  # this host's own scratch
    try:
        checkpoint.save(staging, model=model, optimizer=optimizer, step=step)
        target = posixpath.join(path, name)
        from ray_train_tpu._compat import ray_train as compat_ray

        for f in sorted(os.listdir(staging)):
            if f != checkpoint.MANIFEST:
                compat_ray.storage_upload(os.path.join(staging, f), fs, posixpath.join(target, f))
        _barrier()  # every rank's files are up: now the manifest, which makes the checkpoint complete
        if _rank_world()[0] == 0:
            compat_ray.storage_upload(os.path.join(staging, checkpoint.MANIFEST), fs,
                                      posixpath.join(target, checkpoint.MANIFEST))
        _barrier()
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load(directory: str, *, model, optimizer, filesystem: Any = None) -> int:
    """`ray_train_tpu.checkpoint.load` of ``directory`` (from `latest`); returns its step."""
    from ray_train_tpu import checkpoint

    fs, path = resolve(directory, filesystem)
    if fs is None:
        return checkpoint.load(path, model=model, optimizer=optimizer).step
    from ray_train_tpu._compat import ray_train as compat_ray

    staging = tempfile.mkdtemp(prefix="grpo_ckpt_")
    try:
        compat_ray.storage_download(fs, path, staging)
        return checkpoint.load(staging, model=model, optimizer=optimizer).step
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- on the driver

def latest(root: str, filesystem: Any = None) -> Optional[str]:
    """The complete checkpoint with the highest step under ``root`` (None if none):
    one whose manifest is there and lists files that are all there, in full."""
    from ray_train_tpu import checkpoint

    fs, path = resolve(root, filesystem)
    if fs is None:
        found = checkpoint.latest_checkpoint(path)
        return None if found is None else str(found)
    from ray_train_tpu._compat import ray_train as compat_ray

    best = None
    for name in compat_ray.storage_list(fs, path):
        step = _complete_step(fs, posixpath.join(path, name))
        if step is not None and (best is None or step > best[0]):
            best = (step, name)
    return None if best is None else join(root, best[1])


def _complete_step(fs, directory: str) -> Optional[int]:
    import pyarrow.fs

    from ray_train_tpu import checkpoint

    try:
        with fs.open_input_stream(posixpath.join(directory, checkpoint.MANIFEST)) as f:
            manifest = json.loads(f.read())
    except (OSError, FileNotFoundError, ValueError):
        return None
    files = manifest.get("files", {})
    infos = fs.get_file_info([posixpath.join(directory, n) for n in files])
    for (name, want), info in zip(files.items(), infos):
        if info.type != pyarrow.fs.FileType.File or info.size < want.get("size", 0):
            logger.warning("GRPO checkpoint %s is incomplete (%s missing or short): skipped", directory, name)
            return None
    return int(manifest["step"])


def host_check(model_dir: str, marker: Optional[str]) -> dict:
    """Runs on a host: whether it sees ``model_dir`` (with its ``config.json``) and
    the checkpoint ``marker`` file. On a simulated host, a path on another host's
    disk is not seen (`ray_train_tpu.testing.simulated_cluster.host_sees`)."""
    import ray

    own_disk = _environ.get(C.RAY_TRAIN_TPU_SIMULATE_HOST_ROOT)

    def sees(path: str, file: bool) -> bool:
        if own_disk:
            from ray_train_tpu.testing.simulated_cluster import host_sees

            if not host_sees(path, own_disk):
                return False
        return os.path.isfile(path) if file else os.path.isdir(path)

    return {"ip": ray.util.get_node_ip_address(), "slice": _environ.get(C.TPU_NAME),
            "worker": _environ.get(C.TPU_WORKER_ID),
            "model_dir": sees(model_dir, False) and sees(os.path.join(model_dir, "config.json"), True),
            "checkpoint_dir": None if marker is None else sees(marker, True)}


def check_hosts(model_dir: str, checkpoint_root: Optional[str], trainer_nodes: Sequence[str],
                engine_nodes: Sequence[str], timeout_s: float = 120.0) -> None:
    """One task per trainer and engine host (Ray node ids): ValueError naming every
    host that does not see ``model_dir`` or (trainer hosts, a local
    ``checkpoint_root``) the driver's checkpoint directory."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker = None
    fs, local = resolve(checkpoint_root) if checkpoint_root is not None else (True, None)
    if fs is None:  # a path: the one the driver sees must be the one every trainer host sees
        Path(local).mkdir(parents=True, exist_ok=True)
        marker = os.path.join(local, _MARKER + uuid.uuid4().hex)
        Path(marker).write_text("written by the driver: every trainer host must see this file\n")
    roles: dict = {}
    for node in trainer_nodes:
        roles.setdefault(node, set()).add("trainer")
    for node in engine_nodes:
        roles.setdefault(node, set()).add("engine")
    task = ray.remote(num_cpus=0, max_retries=0)(host_check)
    try:
        refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            model_dir, marker if "trainer" in role else None) for node, role in roles.items()}
        reports = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s)))
    finally:
        if marker is not None:
            Path(marker).unlink(missing_ok=True)
    problems = []
    for node, r in reports.items():
        where = f"host {r['ip']} (slice {r['slice']!r}, TPU worker {r['worker']}; {' and '.join(sorted(roles[node]))})"
        if not r["model_dir"]:
            problems.append(f"{where} does not see model_dir {model_dir!r} (no directory with a config.json there)")
        if r["checkpoint_dir"] is False:
            problems.append(f"{where} does not see checkpoint_dir {checkpoint_root!r} as the driver does (a file "
                            "the driver wrote there is not on this host: a directory on the driver's own disk)")
    if problems:
        fixes = []
        if any("model_dir" in p for p in problems):
            fixes.append("put the model directory on storage every host mounts, or the same path on every host")
        if any("checkpoint_dir" in p for p in problems):
            fixes.append(_FIX)
        raise ValueError("GRPOConfig: every trainer and engine host must see the model and the checkpoint "
                         f"directory: {'; '.join(problems)}. Fix: {'; '.join(fixes)}")
