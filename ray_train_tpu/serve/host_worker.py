"""One Ray actor per TPU host of a serving replica's slice.

Each holds its host's bundle of the slice placement group, gets the TorchTPU
environment that `launch_env` computes (the training backend's code path:
`_worker.report` / `_worker.apply_env`), and the lead host (TPU worker id 0)
loads the model on its device and generates. Device: ``tpu`` on a real slice
(checked; never a CPU fallback), CPU only in explicit simulation.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Optional

from ray_train_tpu import _environ, _worker


def _text_of(content: Any) -> str:
    """OpenAI message content (a string or a list of parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(part.get("text", ""))
        else:
            raise ValueError(f"message content part {part!r} is not text; only text is supported")
    return "".join(parts)


class HostWorker:
    """The actor class; the engine wraps it with ``ray.remote``."""

    def __init__(self):
        self._model = None
        self._tokenizer = None
        self._device = None
        self._lock = threading.Lock()
        self._env: dict = {}

    def report(self) -> dict:
        return _worker.report()

    def setup(self, env: dict, mode: str) -> dict:
        """Apply the TorchTPU env (as the training backend does); returns what is set."""
        _worker.apply_env(env, mode)
        self._env = _environ.snapshot(list(env))
        return self._env

    def describe(self) -> dict:
        """Where this worker is and the env it was given (for people and tests)."""
        return {"report": _worker.report(), "env": dict(self._env), "loaded": self._model is not None}

    def load(self, source: str, dtype: str = "float32") -> dict:
        import ray_train_tpu
        from ray_train_tpu.serve.models import load_causal_lm

        self._device = ray_train_tpu.get_device()
        self._model, self._tokenizer = load_causal_lm(source, self._device, dtype)
        return {"device": str(self._device), "architecture": type(self._model).__name__}

    def ping(self) -> bool:
        return True

    def encode(self, kind: str, prompt: Any) -> list[int]:
        """Token ids of a chat (list of messages, with the chat template) or a
        completion prompt (a string)."""
        tok = self._tokenizer
        if kind == "chat":
            messages = [{"role": m["role"], "content": _text_of(m.get("content"))} for m in prompt]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(prompt)["input_ids"]

    def generate(
        self, kind: str, prompt: Any, max_tokens: int, temperature: Optional[float],
        top_p: Optional[float], seed: Optional[int],
    ) -> Iterator[dict]:
        """Stream ``{"text": ...}`` pieces, then ``{"finish_reason", "prompt_tokens",
        "completion_tokens"}``. Greedy when temperature is 0."""
        import torch
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self._tokenizer, skip_prompt=True, skip_special_tokens=True)
        sample = temperature is not None and temperature > 0
        kwargs = dict(max_new_tokens=max_tokens, do_sample=sample, streamer=streamer,
                      pad_token_id=self._tokenizer.eos_token_id)
        if sample:
            kwargs.update(temperature=temperature, top_p=1.0 if top_p is None else top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        out: dict = {}

        def run():
            # One request at a time on the device; the tokenizer too (a fast
            # tokenizer must not be used from two threads at once).
            with self._lock, torch.no_grad():
                try:
                    ids = self.encode(kind, prompt)
                    out["prompt_tokens"] = len(ids)
                    input_ids = torch.tensor([ids], device=self._device)
                    if seed is not None:
                        torch.manual_seed(seed)
                    out["ids"] = self._model.generate(
                        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs
                    )
                except BaseException as e:  # surfaced below, after the streamer ends
                    out["error"] = e
                    streamer.end()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        for piece in streamer:
            if piece:
                yield {"text": piece}
        thread.join()
        if "error" in out:
            raise out["error"]
        n = int(out["ids"].shape[1]) - out["prompt_tokens"]
        yield {
            "finish_reason": "length" if n >= max_tokens else "stop",
            "prompt_tokens": out["prompt_tokens"],
            "completion_tokens": n,
        }
