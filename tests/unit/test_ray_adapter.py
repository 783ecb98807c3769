"""The Ray adapter: pinned to the Ray it was written against, and its seams exist."""

import inspect
import types

import ray
from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

from ray_train_tpu import _ray_adapter


def test_pinned_ray_version_and_seams_exist():
    assert ray.__version__ == _ray_adapter.TESTED_RAY_VERSION
    # the one call site of the seam we replace, for TPU workers only
    source = inspect.getsource(WorkerGroup._assign_worker_ranks)
    assert "WorkerGroup._sort_workers_by_tpu_pod_name(workers)" in source
    from ray.train.torch.train_loop_utils import _TorchAccelerator

    assert list(inspect.signature(_TorchAccelerator.prepare_model).parameters)[:5] == [
        "self", "model", "move_to_device", "parallel_strategy", "parallel_strategy_kwargs"]
    import ray.air._internal.device_manager as dm

    assert hasattr(dm, "_torch_device_manager") and hasattr(dm, "_torch_device_manager_lock")


def test_install_is_idempotent_and_reversible():
    import ray_train_tpu.config  # noqa: F401  (installs on import, as in the controller)

    assert _ray_adapter.tpu_worker_order_installed()
    _ray_adapter.install_tpu_worker_order()
    assert _ray_adapter.tpu_worker_order_installed()
    _ray_adapter.uninstall_tpu_worker_order()
    assert not _ray_adapter.tpu_worker_order_installed()
    _ray_adapter.install_tpu_worker_order()


def _worker(ip, tpu):
    return types.SimpleNamespace(metadata=types.SimpleNamespace(node_ip=ip, accelerator_ids={"TPU": [str(tpu)]}))


def test_order_follows_slice_worker_id_and_chip_not_ip_or_arrival():
    # host with TPU worker id 0 has the *higher* IP; arrival order is scrambled
    workers = [_worker("10.0.0.1", 2), _worker("10.0.0.9", 1), _worker("10.0.0.1", 0), _worker("10.0.0.9", 0)]
    identities = [("s", "1"), ("s", "0"), ("s", "1"), ("s", "0")]
    ordered = _ray_adapter.order_tpu_workers(workers, identities)
    assert [(w.metadata.node_ip, w.metadata.accelerator_ids["TPU"][0]) for w in ordered] == [
        ("10.0.0.9", "0"), ("10.0.0.9", "1"), ("10.0.0.1", "0"), ("10.0.0.1", "2")]
    # slices by name first
    two = _ray_adapter.order_tpu_workers(
        [_worker("a", 0), _worker("b", 0)], [("slice-b", "0"), ("slice-a", "0")])
    assert [w.metadata.node_ip for w in two] == ["b", "a"]
