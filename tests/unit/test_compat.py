"""The `_compat` seams: pinned to the versions they were written against, and
every private name they touch still exists there."""

import inspect
import types

import ray
import torch
from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

from ray_train_tpu import constants as C
from ray_train_tpu._compat import ray_train as compat_ray
from ray_train_tpu._compat import torch as compat_torch
from ray_train_tpu._compat import torch_tpu as compat_torch_tpu


def test_pinned_ray_version_and_seams_exist():
    assert ray.__version__ == compat_ray.TESTED_RAY_VERSION == C.RAY_VERSION
    # the one call site of the seam we replace, for TPU workers only
    source = inspect.getsource(WorkerGroup._assign_worker_ranks)
    assert "WorkerGroup._sort_workers_by_tpu_pod_name(workers)" in source
    from ray.train.torch.train_loop_utils import _TorchAccelerator

    assert list(inspect.signature(_TorchAccelerator.prepare_model).parameters)[:5] == [
        "self", "model", "move_to_device", "parallel_strategy", "parallel_strategy_kwargs"]
    import ray.air._internal.device_manager as dm

    assert hasattr(dm, "_torch_device_manager") and hasattr(dm, "_torch_device_manager_lock")
    assert callable(dm.register_custom_torch_dist_backend)
    from ray._private import state
    from ray._private.accelerators import tpu as ray_tpu

    assert callable(state.actors) and callable(ray_tpu._get_tpu_metadata)
    from ray.train.torch import TorchConfig

    assert issubclass(TorchConfig().backend_cls, compat_ray.RayTorchBackend)


def test_pinned_torch_version_and_seams_exist():
    assert compat_torch.version_matches(torch.__version__), (torch.__version__, C.TORCH_VERSION)
    assert not compat_torch.version_matches("2.1.0") and compat_torch.version_matches(C.TORCH_VERSION + ".0+cpu")
    # no torch_tpu loaded here (TORCH_DEVICE_BACKEND_AUTOLOAD=0): PrivateUse1 keeps torch's default name
    assert compat_torch.privateuse1_backend_name() == "privateuseone"


def test_pinned_torch_tpu_version_and_seam_exists():
    from importlib import metadata

    assert metadata.version("torch-tpu") == compat_torch_tpu.TESTED_TORCH_TPU_VERSION == C.TORCH_TPU_VERSION
    import importlib.util

    assert importlib.util.find_spec("torch_tpu._internal.utils.hardware") is not None


def test_install_is_idempotent_and_reversible():
    import ray_train_tpu.config  # noqa: F401  (installs on import, as in the controller)
    from ray_train_tpu import _backend, _worker_fns

    def ours():
        return dict(identify=_worker_fns.host_identity, host_positions=_backend._host_positions)

    installed = WorkerGroup.__dict__["_sort_workers_by_tpu_pod_name"].__func__
    assert installed.keywords == ours()  # the same host order as discovery.layout
    assert compat_ray.installed_tpu_worker_sort() is compat_ray.sort_tpu_workers
    compat_ray.install_tpu_worker_order(**ours())
    assert compat_ray.installed_tpu_worker_sort() is compat_ray.sort_tpu_workers
    compat_ray.uninstall_tpu_worker_order()
    assert compat_ray.installed_tpu_worker_sort() is not compat_ray.sort_tpu_workers
    compat_ray.install_tpu_worker_order(**ours())


def _worker(ip, tpu):
    return types.SimpleNamespace(metadata=types.SimpleNamespace(node_ip=ip, accelerator_ids={"TPU": [str(tpu)]}))


def test_order_follows_slice_worker_id_and_chip_not_ip_or_arrival():
    # host with TPU worker id 0 has the *higher* IP; arrival order is scrambled
    workers = [_worker("10.0.0.1", 2), _worker("10.0.0.9", 1), _worker("10.0.0.1", 0), _worker("10.0.0.9", 0)]
    identities = [("s", "1"), ("s", "0"), ("s", "1"), ("s", "0")]
    ordered = compat_ray.order_tpu_workers(workers, identities)
    assert [(w.metadata.node_ip, w.metadata.accelerator_ids["TPU"][0]) for w in ordered] == [
        ("10.0.0.9", "0"), ("10.0.0.9", "1"), ("10.0.0.1", "0"), ("10.0.0.1", "2")]
    # slices by name first
    two = compat_ray.order_tpu_workers(
        [_worker("a", 0), _worker("b", 0)], [("slice-b", "0"), ("slice-a", "0")])
    assert [w.metadata.node_ip for w in two] == ["b", "a"]


def test_call_in_actor_runs_a_function_in_any_actor():
    calls = []

    class _Method:
        def remote(self, fn, *args, **kwargs):
            calls.append(fn("the actor instance", *args, **kwargs))

    compat_ray.call_in_actor(types.SimpleNamespace(__ray_call__=_Method()), lambda a, b=0: a + b, 2, b=3)
    assert calls == [5]


def test_elastic_preemption_and_hang_seams_exist():
    """The Ray Train 2.60 internals behind add_worker_group_poll_hook, preemption_pending,
    preemption_deadline_s, drain_node, raylet_pid and controller_state_log; the torch ones behind
    collective_sequence_numbers and batches_yielded."""
    from ray._private import ray_constants
    from ray._raylet import InnerGcsClient  # what GcsClient delegates drain_node to
    from ray.core.generated import autoscaler_pb2
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    from ray.train.v2._internal.execution.preemption import PreemptionContext
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus
    from ray.train.v2.api.preemption import PreemptionInfo

    assert "callback.after_worker_group_poll_status(worker_group_poll_status)" in inspect.getsource(WorkerGroup.poll_status)
    assert "self._callbacks = " in inspect.getsource(WorkerGroup.__init__)
    assert callable(WorkerGroupCallback.after_worker_group_poll_status)
    from ray.train.v2._internal.execution.callback import ControllerCallback
    from ray.train.v2._internal.execution.controller.state import RestartingState

    assert callable(ControllerCallback.after_controller_state_update)
    assert "training_failed_error" in inspect.signature(RestartingState.__init__).parameters
    assert isinstance(compat_ray.controller_state_log("/tmp/x.jsonl"), ControllerCallback)
    status = WorkerGroupPollStatus(worker_statuses={})
    assert status.get_preemption_info() is None and status.errors == {}
    assert PreemptionContext().preemption_info is None
    assert "deadline_ms" in PreemptionInfo.__dataclass_fields__
    assert callable(InnerGcsClient.drain_node)
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0
    assert ray_constants.PROCESS_TYPE_RAYLET == "raylet"
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    assert all(hasattr(c10d._world, name) for name in ("pg_map", "pg_names", "pg_group_ranks"))
    assert hasattr(dist.ProcessGroup, "_get_sequence_number_for_group")
    assert compat_torch.collective_sequence_numbers() == {}  # no process group here
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    it = iter(loader)
    next(it)
    assert compat_torch.batches_yielded(it) == 1
    assert compat_ray.drain_node("ab" * 28, 5, "test")[0] is False  # not connected: refused, no exception
