"""Fixtures shared by unit-test modules."""

import logging
import os

import pytest


@pytest.fixture
def vllm_importable():
    """libtpu is installed here: vLLM imports only in explicit simulation. Importing it
    also sets variables and a root log handler: give them back."""
    from ray_train_tpu import constants as C

    env, root = dict(os.environ), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    os.environ[C.RAY_TRAIN_TPU_SIMULATE] = "1"
    yield
    os.environ.clear()
    os.environ.update(env)
    root.handlers[:] = handlers
    root.setLevel(level)
