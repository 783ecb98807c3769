"""Distributed tests: a simulated TPU cluster per module, real Ray scheduling, gloo.

A module that sets ``SIMULATED_SLICE = dict(topology=..., accelerator_type=...,
...)`` (`simulated_tpu_cluster`'s arguments) gets its cluster from the `sim`
fixture here, started once for the module and torn down after it.
"""

import sys

import pytest


@pytest.fixture(autouse=True, scope="module")
def _pickle_test_module_by_value(request):
    """Ray workers cannot import test modules; ship their functions by value."""
    import ray.cloudpickle as cloudpickle

    module = sys.modules[request.module.__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def sim(request):
    """The module's simulated cluster, from its ``SIMULATED_SLICE`` arguments."""
    from ray_train_tpu.testing import simulated_tpu_cluster

    kwargs = getattr(request.module, "SIMULATED_SLICE", None)
    if kwargs is None:
        raise pytest.UsageError(f"{request.module.__name__} uses `sim` but sets no SIMULATED_SLICE")
    with simulated_tpu_cluster(**kwargs) as cluster:
        yield cluster
