"""Shared test set-up. Runs before any test module imports torch."""

import os

# libtpu must never query the cloud metadata server (off limits here; a stall of
# minutes), and torch must not autoload torch_tpu in tests: set both before torch
# is imported in this process and in every process it starts.
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

# Hypothesis's pytest plugin imports hypothesis in its end-of-run summary when no
# test did; after a run that started vLLM engines, CPython 3.11's parser then
# fails that import ("AST constructor recursion depth mismatch") and pytest exits
# 1 after every test passed. Imported here, at start-up, it never is imported late.
import hypothesis  # noqa: E402,F401


import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _pytest_temp_dirs_outside_any_simulated_host(tmp_path_factory):
    """pytest makes its base temporary directory lazily, under ``TMPDIR`` at the
    first ``tmp_path``. A simulated cluster points the driver's ``TMPDIR`` at the
    head host's own disk while it is up and removes that disk with the cluster,
    so a base made then would vanish under every later module: make it now."""
    tmp_path_factory.getbasetemp()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_connection_outlives_its_module(request):
    """A module that leaves this process connected to Ray changes what every later
    module sees (a CLI that would connect uses the stale connection instead; Ray's
    log filter starts asking the runtime context): fail that module, by name, and
    disconnect, so the damage stops there."""
    ray = sys.modules.get("ray")
    before = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if not before and ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{request.module.__name__} left this process connected to Ray; "
                    "shut it down in the fixture or test that connected", pytrace=False)
