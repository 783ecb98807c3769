"""GRPO's arithmetic, in plain torch: group advantages, token log-probs, the loss.

Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath) samples
``G`` completions per prompt and uses each completion's reward relative to its
group (``(r - mean) / (std + eps)``) as the advantage of all its tokens, so no
value model is needed. The loss is PPO's clipped surrogate per completion
token, averaged over all completion tokens of the batch (token-level mean, as
DAPO and verl's default do). With one optimizer step per batch of rollouts the
ratio is 1 and the clip is inactive; it matters once a batch is reused.

Example:
    >>> import torch
    >>> group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2]]))
    tensor([[ 0.9998, -0.9998, -0.9998,  0.9998],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within each row of ``rewards`` [prompts, G].

    A group whose rewards are all equal carries no signal: its advantages are 0.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_prompts, samples_per_prompt >= 2], got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclasses.dataclass
class Batch:
    """Prompt + completion tokens, right-padded, ready for a causal LM.

    ``loss_mask[i, t]`` is 1 where token ``t`` of row ``i`` is a completion token
    (its log-prob comes from the logits at ``t - 1``); ``advantages`` is per row.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B] float
    engine_logprobs: torch.Tensor  # [B, T] float: the sampler's log-probs of completion tokens (0 elsewhere)

    def rows(self, index) -> "Batch":
        return Batch(self.input_ids[index], self.attention_mask[index], self.loss_mask[index],
                     self.advantages[index], self.engine_logprobs[index])

    @property
    def num_completion_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def build_batch(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                advantages: Sequence[float], pad_id: int,
                completion_logprobs: Optional[Sequence[Sequence[float]]] = None) -> Batch:
    """One row per (prompt, completion) pair.

    Example:
        >>> b = build_batch([[5, 6], [5]], [[7, 2], [8]], [1.0, -1.0], pad_id=0)
        >>> b.input_ids.tolist(), b.loss_mask.tolist()
        ([[5, 6, 7, 2], [5, 8, 0, 0]], [[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    """
    if not len(prompt_ids) == len(completion_ids) == len(advantages):
        raise ValueError(f"build_batch: {len(prompt_ids)} prompts, {len(completion_ids)} completions and "
                         f"{len(advantages)} advantages must be as many")
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(ids.shape, dtype=torch.float32)
    sampled = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        row = list(p) + list(c)
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attn[i, : len(row)] = 1
        mask[i, len(p): len(row)] = 1.0
        if completion_logprobs is not None:
            sampled[i, len(p): len(row)] = torch.tensor(list(completion_logprobs[i]), dtype=torch.float32)
    return Batch(ids, attn, mask, torch.tensor(list(advantages), dtype=torch.float32), sampled)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, placed at position t (position 0 is 0).

    Example:
        >>> logits = torch.zeros(1, 3, 4)   # uniform over 4 tokens
        >>> token_logprobs(logits, torch.tensor([[1, 2, 3]])).exp()
        tensor([[1.0000, 0.2500, 0.2500]])
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, num_tokens: int, clip_eps: float = 0.2) -> torch.Tensor:
    """The clipped surrogate, summed over completion tokens and divided by
    ``num_tokens`` (the completion tokens of the whole batch, all ranks).

    Each rank passes its rows; since data-parallel gradients are averaged over
    ranks, multiply by the world size to get the token mean of the whole batch.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    return -(surrogate * loss_mask).sum() / max(num_tokens, 1)
