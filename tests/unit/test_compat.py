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


def test_simulated_tpu_device_seams_exist():
    """The private torch APIs that `_compat.simulated_tpu` builds the simulated
    device from, checked without registering it (that renames PrivateUse1 for
    the life of the process; tests/unit/test_simulated_device.py runs it in
    spawned processes)."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the op below)
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    assert list(inspect.signature(_setup_privateuseone_for_python_backend).parameters) == [
        "rename", "backend_module", "hook", "device_guard"]
    assert {"PrivateUse1Hooks", "DeviceGuard"} <= set(dir(torch._C._acc))
    assert callable(torch._C._disabled_torch_function_impl) and callable(torch._C._get_privateuse1_backend_name)
    assert _make_subclass_accepts_device()
    assert callable(torch._utils._rebuild_device_tensor_from_cpu_tensor)
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.native_dropout.default.tags
    assert torch.ops.prim.device.default is not None
    assert torch.ops._c10d_functional._wrap_tensor_autograd.default.name() == "_c10d_functional::_wrap_tensor_autograd"
    from ray.air._internal.device_manager.tpu import TPUTorchDeviceManager

    assert callable(TPUTorchDeviceManager.is_available) and callable(TPUTorchDeviceManager.get_devices)


def _make_subclass_accepts_device() -> bool:
    class Probe(torch.Tensor):
        pass

    made = torch.Tensor._make_subclass(Probe, torch.zeros(1), False, dispatch_device=True,
                                       device_for_backend_keys=torch.device("cpu"))
    return isinstance(made, Probe)
