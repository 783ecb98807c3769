"""Every touch of a Ray internal, in one small module, pinned to the Ray we test.

Pinned to `constants.RAY_VERSION`; tests/unit/test_compat.py checks each seam.

Ray 2.60 orders TPU workers by ``TPU_NAME`` alone
(``WorkerGroup._sort_workers_by_tpu_pod_name``), which the whole slice shares,
so node and local ranks end up in whatever order the workers happened to start.
The narrowest seam is that one static method: ``_assign_worker_ranks`` calls it
for TPU workers only, then derives world rank (list position), node rank (first
appearance of each node IP) and local rank (position among the node's workers)
from the list it returns. We replace it with a sort by (slice name, host
position, Ray TPU accelerator id), which makes Ray's ranks equal the ranks of
`ray_train_tpu.layout`. The host position comes from the function the backend
installs (`discovery.order_slice_hosts`: chip coordinates when every host has
them, else TPU worker id), the same one `layout` uses. The method runs in the
Train controller actor, which imports the backend (and so installs it) when it
unpickles `TPUTorchConfig`.

Also here: the process-wide torch device manager that Ray picks for a worker
holding TPU resources (``TPUTorchDeviceManager`` -> ``torch.device("tpu")``),
which explicit simulation replaces with the CPU one, and the GCE metadata query
that simulation forbids.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict
from typing import Any, Callable, List, Optional

import ray
from ray.train.torch.config import _TorchBackend
from ray.train.v2._internal.execution.callback import TrainContextCallback
from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

logger = logging.getLogger(__name__)

TESTED_RAY_VERSION = C.RAY_VERSION

# Ray Train's private torch backend (``ray.train.torch.config._TorchBackend``):
# our backend extends it, as Ray's own TorchConfig backend does.
RayTorchBackend = _TorchBackend
# A RunConfig callback of this (private) class is copied to every worker, where Ray
# Train enters its ``on_report()`` context around each ``ray.train.report`` call
# (the public ``UserCallback`` runs in the controller only). `progress` reads the
# chip's memory there.
WorkerReportCallback = TrainContextCallback
_ORIGINAL_SORT = WorkerGroup.__dict__["_sort_workers_by_tpu_pod_name"]
_UNKNOWN = 1 << 30


def _host_identity() -> tuple[Optional[str], Optional[str]]:
    """Runs on a worker: its host's slice name and TPU worker id, from env only
    (Ray's own helper falls back to the GCE metadata server)."""
    return _environ.get(C.TPU_NAME), _environ.get(C.TPU_WORKER_ID)


def _as_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return _UNKNOWN


HostPositions = Callable[[Optional[str], list], dict]  # (slice name, [(ip, worker id, chip)]) -> {ip: position}


def sort_tpu_workers(workers: List[Any], identify: Callable = _host_identity,
                     host_positions: Optional[HostPositions] = None) -> List[Any]:
    """Replacement for ``WorkerGroup._sort_workers_by_tpu_pod_name``: order by
    (slice name, host position, TPU accelerator id, node IP). `identify` runs
    on each worker and returns (TPU_NAME, TPU_WORKER_ID[, chip coordinates])."""
    identities = ray.get([w.execute_async(identify) for w in workers])
    return order_tpu_workers(workers, identities, host_positions)


def order_tpu_workers(workers: List[Any], identities: List[tuple],
                      host_positions: Optional[HostPositions] = None) -> List[Any]:
    """`workers` sorted by slice name and host position, then by the lowest Ray
    TPU accelerator id of each and its node IP. `identities` are each worker's
    (slice name, TPU worker id[, chip coordinates]); `host_positions` places
    the hosts of one slice (default: by TPU worker id)."""
    positions = _positions(workers, identities, host_positions)

    def key(i: int):
        worker = workers[i]
        tpu_ids = worker.metadata.accelerator_ids.get("TPU") or []
        position = positions.get((identities[i][0], worker.metadata.node_ip))
        return (
            identities[i][0] or "",
            _UNKNOWN if position is None else position,
            min((_as_int(t) for t in tpu_ids), default=_UNKNOWN),
            worker.metadata.node_ip,
        )

    return [workers[i] for i in sorted(range(len(workers)), key=key)]


def _positions(workers, identities, host_positions: Optional[HostPositions]) -> dict:
    by_slice: dict = defaultdict(list)
    for worker, identity in zip(workers, identities):
        worker_id = _as_int(identity[1])
        chip = identity[2] if len(identity) > 2 else None
        by_slice[identity[0]].append((worker.metadata.node_ip, None if worker_id == _UNKNOWN else worker_id, chip))
    out = {}
    for name, claims in by_slice.items():
        found = host_positions(name, claims) if host_positions else {ip: w for ip, w, _ in claims}
        out.update({(name, ip): p for ip, p in found.items()})
    return out


def install_tpu_worker_order(identify: Callable = _host_identity, host_positions: Optional[HostPositions] = None) -> None:
    """Make Ray Train order TPU workers by slice, host position and chip.
    Idempotent. `identify` and `host_positions` as in `sort_tpu_workers`."""
    if ray.__version__ != TESTED_RAY_VERSION:
        logger.warning(
            "ray_train_tpu's worker-order adapter was tested with Ray %s, found %s; "
            "the backend checks the resulting order and fails if it is wrong",
            TESTED_RAY_VERSION,
            ray.__version__,
        )
    sort = functools.partial(sort_tpu_workers, identify=identify, host_positions=host_positions)
    WorkerGroup._sort_workers_by_tpu_pod_name = staticmethod(sort)


def uninstall_tpu_worker_order() -> None:
    """Give Ray Train back its own TPU worker sort."""
    WorkerGroup._sort_workers_by_tpu_pod_name = _ORIGINAL_SORT


def installed_tpu_worker_sort() -> Any:
    """The function Ray Train now sorts TPU workers with (for ours, `sort_tpu_workers`)."""
    installed = getattr(WorkerGroup.__dict__["_sort_workers_by_tpu_pod_name"], "__func__", None)
    return getattr(installed, "func", installed)


def use_simulated_tpu_device_manager(host: bool = False) -> None:
    """In an explicitly simulated worker: Ray's own TPU device manager, so that
    ``ray.train.torch.get_device()`` is the simulated ``tpu`` device, without
    the ``import torch_tpu`` by which it tells that torch_tpu is there. With
    `host`, Ray's CPU device manager (``RAY_TRAIN_TPU_SIMULATE_DEVICE=host``)."""
    import ray.air._internal.device_manager as dm
    from ray.air._internal.device_manager.cpu import CPUTorchDeviceManager
    from ray.air._internal.device_manager.tpu import TPUTorchDeviceManager

    from ray_train_tpu._compat import simulated_tpu

    if host:
        simulated_tpu.install_host_stand_in()
        with dm._torch_device_manager_lock:
            dm._torch_device_manager = CPUTorchDeviceManager()
        return
    simulated_tpu.install()

    class SimulatedTPUTorchDeviceManager(TPUTorchDeviceManager):
        def is_available(self) -> bool:
            return simulated_tpu.installed()

    with dm._torch_device_manager_lock:
        dm._torch_device_manager = SimulatedTPUTorchDeviceManager()


def forbid_metadata_server() -> Callable[[], None]:
    """Make any GCE metadata query of Ray's TPU code fail loudly; returns an undo
    (`_compat.ray_tpu.answer_metadata_server`)."""
    from ray_train_tpu._compat import ray_tpu

    return ray_tpu.answer_metadata_server(None)


def gcs_actor_table() -> list[dict]:
    """Every actor the GCS knows of (``ray._private.state.actors()``'s values),
    read without the dashboard's state API."""
    from ray._private import state

    return list(state.actors().values())


def load_tpu_dist_backend() -> None:
    """Have Ray register torch_tpu's ``tpu_dist`` process-group backend (it calls
    ``torch_tpu._loader.load()``); ImportError when torch_tpu is absent."""
    from ray.air._internal.device_manager import register_custom_torch_dist_backend

    register_custom_torch_dist_backend("tpu_dist")


def call_in_actor(actor: Any, fn: Callable, *args, **kwargs) -> "ray.ObjectRef":
    """Run ``fn(*args, **kwargs)`` inside any actor's process. ``__ray_call__``
    is the undocumented method every Ray actor has: it calls
    ``fn(actor_instance, ...)``."""
    return actor.__ray_call__.remote(lambda _self, *a, **k: fn(*a, **k), *args, **kwargs)


def release_failed_worker_group(worker_group: Any) -> None:
    """Shut down a worker group whose backend set-up failed.

    Ray 2.60 marks the group started before the backend's ``on_start`` runs,
    so when ``on_start`` raises, ``WorkerGroup._start`` skips its clean-up and
    the controller never receives the group: its workers and slice placement
    group would hold the TPUs until the driver exits. Shutting it down here
    (idempotent with Ray's own clean-up) releases them at once.
    """
    if isinstance(worker_group, WorkerGroup) and worker_group.has_started():
        try:
            worker_group.shutdown()
        except Exception:  # the original error matters more; Ray retries clean-up
            logger.exception("ray_train_tpu: could not shut down the failed worker group")


# Where ``ray.train.torch.prepare_model`` / ``prepare_data_loader`` are looked up:
# the public module (``ray.train.torch.prepare_model(...)`` and imports after the
# routing), and the modules that define them (a train function pickled on the
# driver refers to Ray's function by its defining module and name, resolved in
# the worker when the function is unpickled, after the backend's start-up).
# Train v2 (on by default) exports its own functions, which never call
# ``_TorchAccelerator``; Train v1's call it.
_RAY_PREPARE_MODULES = ("ray.train.torch", "ray.train.torch.train_loop_utils", "ray.train.v2.torch.train_loop_utils")
_ray_originals: dict[str, Callable[..., Any]] = {}


def route_ray_prepare(
    prepare: Callable[..., Any], data_parallel_shard: Callable[[], Optional[tuple[int, int]]]
) -> None:
    """In a TPUTorchTrainer worker, send Ray's ``prepare_model`` to ray_train_tpu's
    strategies (Ray 2.60 passes ``device_ids`` to DDP, which torch_tpu needs
    without, and allows FSDP only with CUDA): `prepare(model, move_to_device,
    parallel_strategy, kwargs)`; and make Ray's ``prepare_data_loader`` shard by
    the data-parallel ranks, ``data_parallel_shard() -> (dp_rank, dp_size)``, so
    that tensor-parallel peers read the same batches (Ray's own
    ``DistributedSampler`` takes the global rank and world size).

    Routed: the functions of ``ray.train.torch`` (Train v2's and v1's) and
    ``_TorchAccelerator.prepare_model``. A name a module bound before the worker
    started (``from ray.train.torch import prepare_model`` in a module the worker
    imported earlier) keeps Ray's function."""
    import importlib

    from ray.train.torch.train_loop_utils import _TorchAccelerator

    public = importlib.import_module("ray.train.torch")
    _ray_originals.setdefault("prepare_data_loader", public.prepare_data_loader)

    def prepare_model(model, move_to_device=True, parallel_strategy="ddp", parallel_strategy_kwargs=None):
        return prepare(model, move_to_device, parallel_strategy, parallel_strategy_kwargs)

    def prepare_data_loader(data_loader, add_dist_sampler=True, move_to_device=True, auto_transfer=True):
        if add_dist_sampler:
            data_loader = _with_data_parallel_sampler(data_loader, data_parallel_shard())
        return _ray_originals["prepare_data_loader"](
            data_loader, add_dist_sampler=add_dist_sampler, move_to_device=move_to_device, auto_transfer=auto_transfer)

    prepare_model.__doc__ = public.prepare_model.__doc__
    prepare_data_loader.__doc__ = _ray_originals["prepare_data_loader"].__doc__
    for name in _RAY_PREPARE_MODULES:
        module = importlib.import_module(name)
        module.prepare_model, module.prepare_data_loader = prepare_model, prepare_data_loader

    def accelerator_prepare_model(self, model, move_to_device=True, parallel_strategy="ddp",
                                  parallel_strategy_kwargs=None):
        return prepare(model, move_to_device, parallel_strategy, parallel_strategy_kwargs)

    _TorchAccelerator.prepare_model = accelerator_prepare_model


def _with_data_parallel_sampler(loader, shard: Optional[tuple[int, int]]):
    """`loader` rebuilt as Ray 2.60's ``prepare_data_loader`` rebuilds it
    (``with_sampler``), with a ``DistributedSampler`` over the data-parallel
    ranks `shard`; `loader` itself where Ray's own sampler (global rank and world
    size) is already right or Ray would add none."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

    if shard is None or shard == (dist.get_rank(), dist.get_world_size()):
        return loader
    if dist.get_world_size() == 1 or isinstance(loader.sampler, DistributedSampler):
        return loader
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return loader
    rank, size = shard
    return DataLoader(
        dataset=loader.dataset, batch_size=loader.batch_size, shuffle=False, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        sampler=DistributedSampler(loader.dataset, num_replicas=size, rank=rank,
                                   shuffle=not isinstance(loader.sampler, SequentialSampler)),
    )


def _train_context():
    """Ray Train 2.60's context of this worker process, or None outside a Ray Train worker."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context()
    except (ImportError, AttributeError, RuntimeError, AssertionError):
        return None


def preemption_pending() -> bool:
    """Ray Train's own preemption notice for this worker (a node Ray Core is
    draining), read locally: the public ``ray.train.get_preemption_info()`` is a
    barrier through the controller."""
    ctx = _train_context()
    try:
        return ctx is not None and ctx.preemption_context.preemption_info is not None
    except AttributeError:
        return False


def wait_for_reports_collected(timeout_s: float) -> bool:
    """Block until the controller has taken every ``ray.train.report`` of this
    worker from its result queue (it takes one per poll, every 2 s by default),
    at most `timeout_s`. A worker that ends its attempt right after reporting
    would otherwise lose the reports still queued: the controller stops polling
    at the first error. True if the queue drained."""
    ctx = _train_context()
    try:
        results = ctx.execution_context.result_queue
    except AttributeError:
        return True
    deadline = time.monotonic() + timeout_s
    while results.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    return not results.unfinished_tasks


# --- rl one-slice mode: Ray's TPU subslices on simulated hosts -------------------------
#
# ``ray.util.tpu.subslice_placement_group`` finds the halves of a slice from each
# host's chip coordinates, which it asks libtpu for (``_discover_tpu_node_coords``,
# one task per host, looked up by name when discovery runs). Simulated hosts have
# no chips: while a subslice is reserved, that one function answers with
# ``coords_fn()`` (run on each host); Ray's discovery, labels, KV cache and
# subslice choice run unchanged. Simulation only.


@contextlib.contextmanager
def simulated_subslice_discovery(coords_fn: Callable[[], list]):
    import ray.util.tpu as ray_tpu

    original = ray_tpu._discover_tpu_node_coords

    def discover(mock_coords=None):
        return original(mock_coords=coords_fn())

    ray_tpu._discover_tpu_node_coords = discover
    try:
        yield
    finally:
        ray_tpu._discover_tpu_node_coords = original


# Ray 2.60's sub-slice search reads free chips from ``available_resources_per_node``
# with ``.get("TPU", total)``, but the GCS leaves a resource whose availability is 0 out
# of a node's entry: a host whose chips are all taken reads as idle, so that Ray can pick
# a busy slice for discovery (and wait 100 s for its head) or a busy sub-slice (a group
# that never becomes ready). Inside this, every node's entry names each of its resources,
# 0 where none is free. Ray's own functions run unchanged.


@contextlib.contextmanager
def zero_filled_availability():
    import ray._private.state as ray_state

    original = ray_state.available_resources_per_node

    def available_resources_per_node():
        avail = original()
        for node, total in ray_state.state.total_resources_per_node().items():
            entry = avail.setdefault(node, {})
            for name in total:
                entry.setdefault(name, 0.0)
        return avail

    ray_state.available_resources_per_node = available_resources_per_node
    try:
        yield
    finally:
        ray_state.available_resources_per_node = original


# --- elastic, preemption and hang detection (issue 26) -----------------------------


def add_worker_group_poll_hook(worker_group: Any, on_poll: Callable[..., None]) -> bool:
    """Call ``on_poll(preempting=..., failing=...)`` after every poll of this
    worker group's status (Ray Train 2.60's ``WorkerGroupCallback.
    after_worker_group_poll_status``, the hook its NCCL hang detector uses);
    a ``ray.train.WorkerGroupError`` raised there fails the attempt, and Ray
    Train retries it against ``FailureConfig(max_failures)``. ``preempting``:
    Ray Train knows of a preemption of this group; ``failing``: some worker
    already failed (Ray Train handles that itself). Appended to the group's
    callbacks (``WorkerGroup._callbacks``), so it lives and dies with this
    attempt's group. False for a group that is not a Ray Train v2 one."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    if not isinstance(worker_group, WorkerGroup):
        return False

    class _PollHook(WorkerGroupCallback):
        def after_worker_group_poll_status(self, worker_group_status) -> None:
            on_poll(preempting=worker_group_status.get_preemption_info() is not None,
                    failing=bool(worker_group_status.errors))

    worker_group._callbacks.append(_PollHook())
    return True


def preemption_deadline_s() -> Optional[float]:
    """Seconds until the deadline of the preemption Ray Train told this worker
    of (``PreemptionInfo.deadline_ms``), None without one (or no notice)."""
    ctx = _train_context()
    try:
        info = ctx.preemption_context.preemption_info if ctx is not None else None
    except AttributeError:
        return None
    if info is None or not info.deadline_ms:
        return None
    return info.deadline_ms / 1000.0 - time.time()


def drain_node(node_id: str, deadline_s: float, reason: str) -> tuple[bool, str]:
    """Ask Ray Core to drain node `node_id` (hex) for a preemption with a deadline
    `deadline_s` from now: what ``ray start`` does itself on SIGTERM
    (``Node._drain_node_before_shutdown``) and KubeRay's autoscaler before it
    removes a pod; the simulated cluster uses it to stand in for them. Ray
    Train's PreemptionWatcher then tells every worker
    (``ray.train.get_preemption_info``), waits for the deadline, and charges the
    restart to ``FailureConfig(max_preemption_failures)``. Needs a connected Ray
    process. Returns (accepted, Ray's message or the error)."""
    from ray.core.generated import autoscaler_pb2

    try:
        accepted, message = ray._private.worker.global_worker.gcs_client.drain_node(
            node_id,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            reason,
            int((time.time() + deadline_s) * 1000),
        )
        return bool(accepted), str(message or "")
    except Exception as e:  # not connected, or GCS unreachable: the caller decides
        return False, f"{type(e).__name__}: {e}"


def in_train_worker() -> bool:
    """True inside a Ray Train 2.60 worker (its train context exists)."""
    return _train_context() is not None


def raylet_pid(node: Any) -> int:
    """The raylet's pid of a ``ray.cluster_utils.Cluster`` node (its worker
    processes are the raylet's children); ``Node.all_processes`` is private."""
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def controller_state_log(path: str) -> Any:
    """For tests and benchmarks: a Ray Train controller callback (pass it in
    ``RunConfig(callbacks=[...])``) that appends every controller state change
    of state type to `path`, one JSON line each: time, previous and new state (e.g.
    ``RunningState`` -> ``PreemptingState`` -> ``RestartingState``), and the
    error that made a Restarting/Errored state (type and message). The states
    and ``ControllerCallback`` are Ray Train 2.60 internals."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    class ControllerStateLog(ControllerCallback):
        def __init__(self, path: str):
            self.path = path

        def after_controller_state_update(self, previous_state, current_state) -> None:
            import json

            if type(previous_state) is type(current_state):  # a poll, or a decision to wait
                return
            error = getattr(current_state, "training_failed_error", None)
            record = {"t": time.time(), "from": type(previous_state).__name__, "to": type(current_state).__name__,
                      "error_type": None if error is None else type(error).__name__,
                      "error": None if error is None else str(error)[:4000]}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    return ControllerStateLog(path)


# Ray Train's storage helpers (``ray.train.v2._internal.execution.storage``): the
# same resolution of a path or URI (``gs://``, ``s3://``, a mounted path) as
# ``RunConfig(storage_path=...)``, and its upload/download/list over pyarrow.fs.
def storage_fs_and_path(storage_path: str, filesystem: Any = None) -> tuple:
    from ray.train.v2._internal.execution import storage

    return storage.get_fs_and_path(storage_path, filesystem)


def storage_upload(local_path: str, fs: Any, fs_path: str) -> None:
    from ray.train.v2._internal.execution import storage

    storage._upload_to_fs_path(local_path, fs, fs_path)


def storage_download(fs: Any, fs_path: str, local_path: str) -> None:
    from ray.train.v2._internal.execution import storage

    storage._download_from_fs_path(fs, fs_path, local_path)


def storage_list(fs: Any, fs_path: str) -> list:
    from ray.train.v2._internal.execution import storage

    return storage._list_at_fs_path(fs, fs_path)
