"""Rewards in parallel: the user's function over every sample, in Ray tasks.

The samples of a step are cut into ``num_workers`` chunks, one Ray task each.
A task never raises for a bad reward: each sample comes back as a number or
as the reason it is not one (the function raised, returned NaN or infinity,
or returned something that is not a real number), so that the driver can stop
the run with a `RewardError` naming the prompt, or skip that prompt's group
and count it. A task that does not answer within ``timeout_s`` is cancelled and
reported, never waited on forever.

The tasks ask for no CPU: the slices' placement groups hold the hosts' CPUs, and a
task waiting for one would wait forever; there are only ``num_workers`` of them.

Example:
    >>> check_reward(0.5), check_reward(float("nan")), check_reward("1")
    ((0.5, None), (None, 'returned nan'), (None, "returned '1' (str), not a number"))
"""

from __future__ import annotations

import math
import numbers
import traceback
from typing import Any, Callable, Optional, Sequence


class RewardError(RuntimeError):
    """The reward function failed on a sample (``on_reward_error="raise"``)."""


def check_reward(value: Any) -> tuple[Optional[float], Optional[str]]:
    """``(reward, None)`` for a finite real number, else ``(None, why)``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        return (value, None) if math.isfinite(value) else (None, f"returned {value}")
    return None, f"returned {value!r:.60} ({type(value).__name__}), not a number"


def score_chunk(reward_fn: Callable, items: Sequence[tuple]) -> list[tuple[Optional[float], Optional[str]]]:
    """``reward_fn(prompt, completion, **fields)`` for each item, checked."""
    out = []
    for prompt, completion, fields in items:
        try:
            out.append(check_reward(reward_fn(prompt, completion, **fields)))
        except Exception as e:  # the user's function: any failure is a result to report
            where = traceback.extract_tb(e.__traceback__)[-1]
            out.append((None, f"raised {type(e).__name__}: {e} ({where.filename}:{where.lineno})"))
    return out


def compute_rewards(reward_fn_ref, items: Sequence[tuple], *, num_workers: int,
                    timeout_s: float) -> list[tuple[Optional[float], Optional[str]]]:
    """Rewards of ``items`` (``(prompt, completion, fields)``), in order, from
    up to ``num_workers`` Ray tasks; ``reward_fn_ref`` is the ``ray.put`` function."""
    import ray

    n = max(1, min(num_workers, len(items)))
    chunks = [list(items[i::n]) for i in range(n)]
    task = ray.remote(num_cpus=0, max_retries=0)(_score_remote)
    refs = [task.remote(reward_fn_ref, chunk) for chunk in chunks]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise RewardError(f"{len(pending)} of {len(refs)} reward tasks did not finish within "
                          f"{timeout_s:.0f} s (GRPOConfig.reward_timeout_s); is reward_fn stuck?")
    try:
        results = ray.get(refs)
    except ray.exceptions.RayError as e:  # the task's process died (the function killed it, or OOM)
        raise RewardError(f"a reward task failed outside reward_fn: {e}") from e
    out: list = [None] * len(items)
    for i, chunk_results in enumerate(results):
        for j, result in enumerate(chunk_results):
            out[i + j * n] = result
    return out


def _score_remote(reward_fn, items):
    return score_chunk(reward_fn, items)
