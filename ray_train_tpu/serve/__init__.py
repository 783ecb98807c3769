"""Serve Hugging Face causal LMs on TPU slices with Ray Serve LLM: one whole
slice per replica, an OpenAI-compatible endpoint, native PyTorch (TorchTPU).

Example:
    >>> from ray import serve                                   # doctest: +SKIP
    >>> from ray_train_tpu.serve import build_llm_config, build_openai_app
    >>> cfg = build_llm_config("HuggingFaceTB/SmolLM2-135M-Instruct", "4x4", "TPU-V6E")  # doctest: +SKIP
    >>> serve.run(build_openai_app([cfg]))                     # doctest: +SKIP

Importing this package is cheap; the names that need Ray Serve LLM (and so
vLLM's protocol classes) load on first use.
"""

from __future__ import annotations

from ray_train_tpu.serve.models import smollm2_gguf
from ray_train_tpu.serve.spec import SliceServeSpec

__all__ = [
    "SliceServeSpec",
    "TorchTPUEngine",
    "TorchTPULLMServer",
    "build_llm_config",
    "build_openai_app",
    "smollm2_gguf",
]

_LAZY = {
    "TorchTPUEngine": "ray_train_tpu.serve.engine",
    "TorchTPULLMServer": "ray_train_tpu.serve.engine",
    "build_llm_config": "ray_train_tpu.serve.builder",
    "build_openai_app": "ray_train_tpu.serve.builder",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_train_tpu.serve' has no attribute {name!r}")
