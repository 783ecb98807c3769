"""The docstring examples of the pure modules run, and pass (doctest).

Listed by name, so that collecting them imports no optional stack (serve's
vLLM, notebooks); examples that need a cluster or a trained model are marked
``# doctest: +SKIP`` in the docstring itself.
"""

import doctest
import importlib

import pytest

MODULES = [
    "ray_train_tpu",
    "ray_train_tpu._validate",
    "ray_train_tpu.topology",
    "ray_train_tpu.scaling",
    "ray_train_tpu.launch_env",
    "ray_train_tpu.discovery",
    "ray_train_tpu._compat.ray_tpu",
    "ray_train_tpu.testing.simulated_cluster",
    "ray_train_tpu.mesh",
    "ray_train_tpu.kuberay",
    "ray_train_tpu.cli.plan",
    "ray_train_tpu.doctor",
    "ray_train_tpu.checkpoint.manifest",
    "ray_train_tpu.checkpoint._hf_names",
    "ray_train_tpu.strategies",
    "ray_train_tpu.strategies.registry",
    "ray_train_tpu.strategies.base",
    "ray_train_tpu.strategies.ddp",
    "ray_train_tpu.strategies.fsdp2",
    "ray_train_tpu.strategies.fsdp2_tp",
    "ray_train_tpu.strategies.tensor_parallel",
]


@pytest.mark.parametrize("name", MODULES)
def test_doctests_pass(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name, globs=dict(vars(module))):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0, f"{name} has no runnable docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (see output)"
