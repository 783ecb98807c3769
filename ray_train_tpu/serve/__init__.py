"""Serve models on TPU slices with Ray Serve LLM's own vLLM engine: one whole
slice per replica, one vLLM worker per device, an OpenAI-compatible endpoint.

Example:
    >>> from ray import serve                                   # doctest: +SKIP
    >>> from ray_train_tpu.serve import build_llm_config, build_openai_app
    >>> cfg = build_llm_config("/models/SmolLM2-135M-Instruct", "4x4", "TPU-V6E")  # doctest: +SKIP
    >>> serve.run(build_openai_app([cfg]))                     # doctest: +SKIP

Importing this package is cheap; the names that need Ray Serve LLM (and so
vLLM) load on first use.
"""

from __future__ import annotations

from ray_train_tpu.serve.models import model_shape, save_tiny_model, smollm2_dir, smollm2_gguf
from ray_train_tpu.serve.spec import ModelShape, SliceServeSpec, size_parallelism

__all__ = [
    "ModelShape",
    "SliceServeSpec",
    "build_llm_config",
    "build_openai_app",
    "model_shape",
    "save_tiny_model",
    "size_parallelism",
    "smollm2_dir",
    "smollm2_gguf",
]

_LAZY = {
    "build_llm_config": "ray_train_tpu.serve.builder",
    "build_openai_app": "ray_train_tpu.serve.builder",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_train_tpu.serve' has no attribute {name!r}")
