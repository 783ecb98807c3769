"""Ready-made prompt records and verifiable rewards.

A reward function is any plain Python function
``reward_fn(prompt, completion, **fields) -> float``: ``prompt`` is the record's
prompt as given (before any chat template), ``completion`` the sampled text,
and ``fields`` the record's other fields (``answer=...``). The loop runs it in
Ray tasks, so it must be picklable (a module-level function or a lambda).

- `addition_records` + `strict_answer_reward`: ``"3+4="`` -> ``"7"``, for the
  character-level tiny model of `ray_train_tpu.rl.models`;
- `chat_addition_records`: the same question in words, for an instruct model
  (its tokenizer's chat template is applied);
- `word_problem_records` + `gsm8k_reward`: GSM8K-style records (``question``,
  ``answer`` ending in ``#### <number>``) made up on the spot, and GSM8K's
  scoring (the completion's final number against the one after ``####``).

Example:
    >>> recs = addition_records(3, max_operand=4, seed=0)
    >>> [(r["prompt"], r["answer"]) for r in recs]
    [('3+3=', '6'), ('0+2=', '2'), ('4+3=', '7')]
    >>> [strict_answer_reward("3+4=", c, answer="7") for c in ("7", "7+1", "The sum is 7.", "6", "71")]
    [1.0, 0.5, 0.5, 0.0, 0.0]
    >>> gsm8k_reward("...", "She has 3 + 4 = 7 apples. #### 7", answer="3 + 4 = 7\\n#### 7")
    1.0
"""

from __future__ import annotations

import random
import re
from typing import Optional

# A bare integer: the strict format every answer must have.
_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def strict_answer_reward(prompt, completion: str, answer: str, **_) -> float:
    """1.0 for exactly the answer (surrounding whitespace ignored); 0.5 for the
    right answer in the wrong format (it is the first integer of the completion,
    but more text follows or precedes it); 0.0 otherwise."""
    text = completion.strip()
    if text == answer:
        return 1.0
    first = _INTEGER.search(text)
    return 0.5 if first is not None and first.group() == answer else 0.0


def addition_records(num_records: int = 1000, *, max_operand: int = 2, seed: int = 0) -> list[dict]:
    """``{"prompt": "a+b=", "answer": "<a+b>"}`` with ``a, b`` in ``0..max_operand``."""
    if not isinstance(max_operand, int) or not 1 <= max_operand <= 99:
        raise ValueError(f"addition_records(max_operand={max_operand!r}) must be an integer in 1..99")
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(num_records)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def chat_addition_records(num_records: int = 1000, *, max_operand: int = 9, seed: int = 0,
                          instruction: Optional[str] = None) -> list[dict]:
    """``{"prompt": "What is a + b? Reply with only the number.", "answer": ...}``
    (the loop applies the tokenizer's chat template)."""
    instruction = instruction or "Reply with only the number."
    return [{"prompt": f"What is {r['prompt'][:-1].replace('+', ' + ')}? {instruction}", "answer": r["answer"]}
            for r in addition_records(num_records, max_operand=max_operand, seed=seed)]


_NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Ivy")
_THINGS = ("apples", "marbles", "stickers", "books", "shells", "coins")


def word_problem_records(num_records: int = 64, *, seed: int = 0, max_number: int = 9) -> list[dict]:
    """GSM8K-style records: ``question`` and an ``answer`` with its working and
    ``#### <number>`` last, as GSM8K writes them."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_records):
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(1, max_number), rng.randint(1, max_number)
        if rng.random() < 0.5:
            q = f"{name} has {a} {thing} and finds {b} more. How many {thing} does {name} have now?"
            work, n = f"{a} + {b} = {a + b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            q = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
            work, n = f"{a} - {b} = {a - b}", a - b
        out.append({"question": q, "answer": f"{work}\n#### {n}"})
    return out


def final_number(text: str) -> Optional[str]:
    """The number after the last ``####``, else the last number in the text
    (commas dropped), or None."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_reward(prompt, completion: str, answer: str, **_) -> float:
    """1.0 if the completion's final number is the reference's (after ``####``), else 0.0."""
    got = final_number(completion)
    return float(got is not None and got == final_number(answer))
