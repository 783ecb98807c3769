"""Prompts for GRPO: records from a list, a generator, a Ray Dataset or a
Hugging Face ``datasets.Dataset``, drawn the same way after every restart.

A record is a mapping with a prompt field (``prompt_key``: a string, or a list
of chat messages ``{"role": ..., "content": ...}``) and any other fields, which
the reward function receives by name (``answer=...``). Sequences with a length
and integer indexing (lists, ``datasets.Dataset``) are read in place; a Ray
Dataset is read once with ``take_all()`` and any other iterable with
``list()``, so an endless generator cannot be used.

Step ``k`` (from 1) takes positions ``(k - 1) * num_prompts ... k * num_prompts - 1``
of an endless stream of epochs, each a seeded permutation of the records: a
resumed or retried step sees the same prompts.

Example:
    >>> src = PromptSource([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)], seed=0)
    >>> [r["prompt"] for r in src.step_records(1, 3)], len(src)
    (['2+1=', '1+1=', '0+1='], 5)
    >>> src.step_records(1, 3) == src.step_records(1, 3)
    True
    >>> PromptSource([], seed=0)
    Traceback (most recent call last):
    ...
    ValueError: GRPOConfig(prompts=[]) must be at least one record, got []; check the dataset's split and filters
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from ray_train_tpu import _validate as V


def _records(prompts: Any) -> Sequence:
    if isinstance(prompts, Sequence) or (hasattr(prompts, "__len__") and hasattr(prompts, "__getitem__")
                                         and type(prompts).__module__.startswith("datasets")):
        return prompts
    if type(prompts).__module__.startswith("ray.data"):
        return prompts.take_all()
    try:
        return list(prompts)
    except TypeError:
        raise V.fail("GRPOConfig", "prompts", prompts, "an iterable of records", error=TypeError) from None


class PromptSource:
    """The records of a run and which of them each step uses."""

    def __init__(self, prompts: Any, *, seed: int, prompt_key: str = "prompt"):
        self.records = _records(prompts)
        self.prompt_key, self.seed = prompt_key, seed
        if len(self.records) == 0:
            raise V.fail("GRPOConfig", "prompts", prompts, "at least one record", "check the dataset's split and "
                         "filters")
        self.record(0)  # a malformed first record fails here, before anything starts
        self._order: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def record(self, index: int) -> Mapping:
        rec = self.records[index]
        if not isinstance(rec, Mapping) or self.prompt_key not in rec:
            keys = sorted(rec) if isinstance(rec, Mapping) else type(rec).__name__
            raise TypeError(f"prompt record {index} must be a mapping with the field {self.prompt_key!r} "
                            f"(GRPOConfig.prompt_key), got {keys}; e.g. {{'prompt': '1+2=', 'answer': '3'}}")
        prompt = rec[self.prompt_key]
        if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
            raise TypeError(f"prompt record {index}: field {self.prompt_key!r} must be a non-empty string or a list "
                            f"of chat messages {{'role': ..., 'content': ...}}, got {prompt!r:.80}")
        return rec

    def _epoch(self, epoch: int) -> list[int]:
        if epoch not in self._order:
            order = list(range(len(self.records)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order = {epoch: order}  # one epoch at a time is enough
        return self._order[epoch]

    def step_indices(self, step: int, num_prompts: int) -> list[int]:
        n = len(self.records)
        positions = range((step - 1) * num_prompts, step * num_prompts)
        return [self._epoch(q // n)[q % n] for q in positions]

    def step_records(self, step: int, num_prompts: int) -> list[Mapping]:
        return [self.record(i) for i in self.step_indices(step, num_prompts)]

    def fields(self, record: Mapping) -> dict:
        """The record's fields for the reward function (all but the prompt)."""
        return {k: v for k, v in record.items() if k != self.prompt_key}


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value))


def renderer(tokenizer, chat_template: Optional[bool]) -> Callable[[Any], str]:
    """``render(prompt) -> text`` for the engine: chat messages through the
    tokenizer's chat template; a string through it too when ``chat_template``
    is True, or None and the tokenizer has one; else the string itself."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError(f"GRPOConfig(chat_template=True) but the tokenizer of {tokenizer.name_or_path!r} has no chat "
                         "template; pass chat_template=None or False, or use an instruct model's tokenizer")
    wrap = has_template if chat_template is None else chat_template

    def render(prompt) -> str:
        if isinstance(prompt, str) and not wrap:
            return prompt
        if not has_template:
            raise ValueError(f"a prompt is a list of chat messages but the tokenizer of {tokenizer.name_or_path!r} "
                             "has no chat template; give string prompts")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render
