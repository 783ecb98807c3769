"""Distributed tests: a simulated TPU cluster per module, real Ray scheduling, gloo."""

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
