"""Prompts made by code and verifiable rewards: what a GRPO run learns.

A task is a prompt generator (deterministic per step and seed) and a reward
function. A reward function is any plain Python function
``reward_fn(prompt: Prompt, completion: str) -> float``; the loop calls it on the
driver for every sample.

Two ready-made tasks, both small addition with a strict answer format:

- `addition_task` for the tiny character-level model of `ray_train_tpu.rl.models`
  (prompt ``"3+4="``, answer ``"7"``);
- `chat_addition_task` for an instruct model with a chat template such as
  SmolLM2-135M-Instruct ("What is 3 + 4? Reply with only the number.").

Example:
    >>> task = addition_task(max_operand=4)
    >>> prompts = task.prompts(step=1, num_prompts=2, seed=0)
    >>> [(p.text, p.answer) for p in prompts]
    [('1+4=', '5'), ('0+2=', '2')]
    >>> [strict_answer_reward(prompts[0], c) for c in ("5", "5+1", "The sum is 5.", "6", "51")]
    [1.0, 0.5, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable, Optional

# A bare integer: the strict format every answer must have.
_INTEGER = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` as the engine sees it, and the reference ``answer``."""

    text: str
    answer: str


RewardFn = Callable[[Prompt, str], float]


def strict_answer_reward(prompt: Prompt, completion: str) -> float:
    """1.0 for exactly the answer (surrounding whitespace ignored); 0.5 for the
    right answer in the wrong format (it is the first integer of the completion,
    but more text follows or precedes it); 0.0 otherwise."""
    text = completion.strip()
    if text == prompt.answer:
        return 1.0
    first = _INTEGER.search(text)
    return 0.5 if first is not None and first.group() == prompt.answer else 0.0


@dataclasses.dataclass(frozen=True)
class Task:
    """A prompt generator and the reward that checks its answers."""

    name: str
    make_prompt: Callable[[int, int], Prompt]  # (a, b) -> Prompt
    max_operand: int = 4
    reward_fn: RewardFn = strict_answer_reward

    def __post_init__(self):
        if not isinstance(self.max_operand, int) or not 1 <= self.max_operand <= 99:
            raise ValueError(f"Task(max_operand={self.max_operand!r}) must be an integer in 1..99")

    def prompts(self, step: int, num_prompts: int, seed: int) -> list[Prompt]:
        """The prompts of one step: the same for the same (step, seed), so that a
        retried or resumed step sees the same prompts."""
        rng = random.Random(seed * 1_000_003 + step)
        pairs = [(rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)) for _ in range(num_prompts)]
        return [self.make_prompt(a, b) for a, b in pairs]


def addition_task(max_operand: int = 4) -> Task:
    """``"a+b="`` -> ``"<a+b>"``, for the character-level tiny model."""
    return Task("addition", lambda a, b: Prompt(f"{a}+{b}=", str(a + b)), max_operand)


def chat_addition_task(apply_chat_template: Callable[[str], str], max_operand: int = 9,
                       instruction: Optional[str] = None) -> Task:
    """A chat prompt asking for the sum and nothing else, for an instruct model.

    ``apply_chat_template(user_message) -> prompt text`` is usually
    ``lambda m: tokenizer.apply_chat_template([{"role": "user", "content": m}],
    tokenize=False, add_generation_prompt=True)``.
    """
    instruction = instruction or "Reply with only the number."

    def make(a: int, b: int) -> Prompt:
        return Prompt(apply_chat_template(f"What is {a} + {b}? {instruction}"), str(a + b))

    return Task("chat_addition", make, max_operand)
