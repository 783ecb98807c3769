"""One step's data on the driver: prompts -> engine requests, completions ->
rewards -> a training batch. Skips are logged and counted, never silent."""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Optional

from ray_train_tpu.rl.rewards import RewardError, compute_rewards

logger = logging.getLogger(__name__)
MAX_LOGGED = 3  # skipped items logged per step (all are counted)


@dataclasses.dataclass
class Prepared:
    """A step's prompts: ``records`` kept, their token ids and engine requests
    (the token ids; requests carry no seed)."""

    step: int
    records: list
    prompt_ids: list
    requests: list
    skipped_too_long: int


def prepare(loop, step: int) -> Prepared:
    """The step's records, rendered and tokenized; a prompt that leaves no room
    for ``max_tokens`` in the engine's context is skipped and counted."""
    c = loop.config
    room = loop.max_model_len - c.sampling.max_tokens
    records, ids, skipped = [], [], 0
    for index in loop.source.step_indices(step, c.num_prompts):
        record = loop.source.record(index)
        tokens = loop.tokenizer(loop.render(record[c.prompt_key]), add_special_tokens=False).input_ids
        if len(tokens) > room:
            if skipped < MAX_LOGGED:
                logger.warning("step %d: prompt record %d has %d tokens; with max_tokens=%d it does not fit the "
                               "engine's context of %d (GRPOConfig.max_model_len): skipped", step, index,
                               len(tokens), c.sampling.max_tokens, loop.max_model_len)
            skipped += 1
            continue
        records.append(record)
        ids.append(tokens)
    if not records:
        raise ValueError(f"step {step}: all {c.num_prompts} prompts are longer than the engine's context allows "
                         f"(GRPOConfig.max_model_len={loop.max_model_len} minus sampling.max_tokens="
                         f"{c.sampling.max_tokens}); raise max_model_len or shorten the prompts")
    # No per-request seed (vllm-torchtpu refuses one): each engine samples from its
    # own engine-wide generator (`rollout.engine_seed`).
    return Prepared(step, records, ids, list(ids), skipped)


def rewards(loop, prepared: Prepared, samples: list) -> tuple[list, list, dict]:
    """``(kept group indices, rewards per kept group, counts)``; a failed reward
    raises `RewardError` or drops its group (``on_reward_error``)."""
    c = loop.config
    items = [(rec[c.prompt_key], s["text"], loop.source.fields(rec))
             for rec, group in zip(prepared.records, samples) for s in group]
    results = compute_rewards(loop.reward_ref, items, num_workers=c.reward_workers, timeout_s=c.reward_timeout_s)
    n = c.sampling.n
    kept, values, errors = [], [], 0
    for g, rec in enumerate(prepared.records):
        group = results[g * n:(g + 1) * n]
        bad = [(j, why) for j, (_, why) in enumerate(group) if why is not None]
        if not bad:
            kept.append(g)
            values.append([v for v, _ in group])
            continue
        errors += len(bad)
        j, why = bad[0]
        what = (f"step {prepared.step}: reward_fn {why} for prompt {str(rec[c.prompt_key])[:60]!r} and completion "
                f"{samples[g][j]['text'][:60]!r}")
        if c.on_reward_error == "raise":
            raise RewardError(what + "; fix reward_fn, or pass GRPOConfig(on_reward_error='skip') to drop such "
                                     "prompts (counted in each step's metrics)")
        if errors - len(bad) < MAX_LOGGED:
            logger.warning("%s (%d of its %d samples failed): the prompt's group is skipped", what, len(bad), n)
    if not kept:
        raise RewardError(f"step {prepared.step}: reward_fn failed on every prompt ({errors} samples); nothing to "
                          "train on")
    return kept, values, {"reward_errors": errors, "prompts_skipped_reward": len(prepared.records) - len(kept)}


def build(loop, prepared: Prepared, samples: list, kept: list, values: list):
    """The padded training batch (advantages from ``values``) and its reward metrics."""
    import torch

    from ray_train_tpu.rl.grpo import build_batch, group_advantages

    adv = group_advantages(torch.tensor(values, dtype=torch.float32), std=loop.config.algorithm.std)
    rows = [(prepared.prompt_ids[g], s, adv[k, j].item()) for k, g in enumerate(kept) for j, s in enumerate(samples[g])]
    batch = build_batch([r[0] for r in rows], [r[1]["token_ids"] for r in rows], [r[2] for r in rows],
                        loop.pad_id, [r[1]["logprobs"] for r in rows])
    multiple = loop.trainer.world_size * loop.config.algorithm.num_minibatches
    return batch.padded(multiple, loop.pad_id), len(rows)


def metrics(values: list, num_rows: int, batch) -> dict:
    flat = [r for group in values for r in group]
    return {"reward_mean": statistics.fmean(flat), "reward_std": statistics.pstdev(flat),
            "reward_min": min(flat), "reward_max": max(flat), "exact": sum(r == 1.0 for r in flat) / len(flat),
            "completion_tokens": batch.num_completion_tokens / max(num_rows, 1)}


def kl_adjusted(values: list, kl_rows: list, coef: float, n: int) -> list:
    """Rewards minus ``coef`` x each completion's summed KL (row order: groups of ``n``)."""
    return [[v - coef * kl_rows[k * n + j] for j, v in enumerate(group)] for k, group in enumerate(values)]


def gather_rows(per_rank: list, num_rows: int) -> list:
    """Rows ``rank::world`` from each rank back into batch order."""
    world = len(per_rank)
    out: list = [None] * num_rows
    for r, part in enumerate(per_rank):
        for i, value in enumerate(part):
            if r + i * world < num_rows:
                out[r + i * world] = value
    return out


def sample_text(samples: list) -> Optional[str]:
    return samples[0][0]["text"] if samples and samples[0] else None
