"""GRPO's arithmetic, in plain torch: advantages, log-probs, KL, the loss, minibatches.

Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath) samples
``G`` completions per prompt and uses each completion's reward relative to its
group, ``A_i = (r_i - mean(r)) / (std(r) + eps)``, as the advantage of all its
tokens, so no value model is needed. As verl (``compute_grpo_outcome_advantage``)
and TRL compute it, ``std`` is the sample standard deviation (``std="sample"``,
Bessel-corrected) and ``eps = 1e-6``; ``std="population"`` divides by ``G``
instead of ``G - 1``, ``std="none"`` only centres (Dr. GRPO). Per completion token
``t`` of row ``i``, as verl's ``compute_policy_loss_vanilla``:

- ratio ``rho = exp(clamp(logp - logp_old, -20, 20))``; ``logp_old`` is the
  policy's own log-prob before this batch's first update
  (``old_logprobs="policy"``) or the sampler's (``"engine"``);
- PPO's clipped surrogate ``pg = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``
  (``eps_high > eps_low`` is DAPO's clip-higher); for ``A < 0`` the dual clip
  (Ye et al., 2019) bounds it by ``-clip_ratio_c * A``: ``pg = min(pg, -c A)``,
  so a token whose ratio exploded cannot dominate the batch;
- with ``"policy"`` old log-probs, a truncated importance weight
  ``w = min(exp(logp_old - logp_engine), cap)`` (detached) multiplies ``pg``: it
  corrects for the sampler differing from the policy (bf16 engine weights, or
  the one-step-stale weights of overlap mode);
- an optional KL penalty to a frozen reference policy, ``k1 = logp - logp_ref``
  or ``k3 = exp(d) - d - 1`` with ``d = clamp(logp_ref - logp, -20, 20)``, the
  result clamped to ``[-10, 10]`` as verl's ``low_var_kl`` (Schulman's
  estimators), either added to the loss (``kl_coef * kl``) or subtracted from
  each completion's reward before the advantages (``r - kl_coef * sum_t kl``).

The per-token losses are aggregated over a minibatch as a token mean
(``sum / tokens``, DAPO's and verl's default) or a sequence mean of token means
(``seq-mean-token-mean``, the GRPO paper's). Each data-parallel rank passes its
rows and the minibatch-wide counts, and its loss is multiplied by the world
size, so that the mean of the ranks' gradients is the whole minibatch's.

Example:
    >>> import torch
    >>> group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2]]))   # sample std 0.5774
    tensor([[ 0.8660, -0.8660, -0.8660,  0.8660],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from ray_train_tpu.rl.config import ADVANTAGE_STDS  # AlgorithmConfig.std's choices

LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi / pi_old) and the k3 log-ratio to [-20, 20] ...
KL_CLAMP = 10.0  # ... and the k3 estimate to [-10, 10]


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, std: str = "sample") -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within each row of ``rewards`` [prompts, G].

    ``std``: ``"sample"`` (Bessel-corrected, verl's and TRL's), ``"population"``,
    or ``"none"`` (``r - mean``, Dr. GRPO). A group whose rewards are all equal
    carries no signal: its advantages are 0.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_prompts, samples_per_prompt >= 2], got shape {tuple(rewards.shape)}")
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"group_advantages(std={std!r}) must be one of {ADVANTAGE_STDS}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if std == "none":
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=std == "sample") + eps)


@dataclasses.dataclass
class Batch:
    """Prompt + completion tokens, right-padded, ready for a causal LM (host tensors).

    ``loss_mask[i, t]`` is 1 where token ``t`` of row ``i`` is a completion token
    (its log-prob comes from the logits at ``t - 1``); ``advantages`` is per row.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B] float
    engine_logprobs: torch.Tensor  # [B, T] float: the sampler's log-probs of completion tokens (0 elsewhere)

    def rows(self, index) -> "Batch":
        return Batch(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))

    def with_advantages(self, advantages: torch.Tensor) -> "Batch":
        return dataclasses.replace(self, advantages=advantages.to(self.advantages.dtype))

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_completion_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def padded(self, multiple: int, pad_id: int) -> "Batch":
        """The batch with dummy rows appended (one pad token, no loss) up to a
        multiple of ``multiple`` rows, so every rank and minibatch gets as many."""
        extra = -self.num_rows % multiple
        if not extra:
            return self
        width = self.input_ids.shape[1]
        ids = torch.full((extra, width), pad_id, dtype=self.input_ids.dtype)
        attn = torch.zeros((extra, width), dtype=self.attention_mask.dtype)
        attn[:, 0] = 1
        zeros = torch.zeros((extra, width), dtype=self.loss_mask.dtype)
        return Batch(torch.cat([self.input_ids, ids]), torch.cat([self.attention_mask, attn]),
                     torch.cat([self.loss_mask, zeros]), torch.cat([self.advantages, torch.zeros(extra)]),
                     torch.cat([self.engine_logprobs, zeros]))


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


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1 under ``softmax(logits / temperature)``,
    placed at position t (position 0 is 0): what the sampler drew from.

    Example:
        >>> logits = torch.zeros(1, 3, 4)   # uniform over 4 tokens
        >>> token_logprobs(logits, torch.tensor([[1, 2, 3]])).exp()
        tensor([[1.0000, 0.2500, 0.2500]])
    """
    logp = torch.log_softmax(logits[:, :-1].to(_at_least_float32(logits.dtype)) / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  temperature: float) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(_at_least_float32(logits.dtype))
    return logits.div_(temperature) if temperature != 1.0 else logits


class _ChunkedLogprobs(torch.autograd.Function):
    """``log softmax((hidden @ weight.T + bias) / temperature)[target]`` per row of
    ``hidden`` [N, H], ``chunk`` rows of logits at a time; the backward recomputes
    each chunk's logits and turns them in place into their gradient
    ``(onehot(target) - softmax) * grad / temperature``, so one float32
    ``[chunk, V]`` buffer is the most that exists at once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk):
        out = torch.empty(hidden.shape[0], dtype=_at_least_float32(hidden.dtype), device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            logits = _chunk_logits(hidden[s:s + chunk], weight, bias, temperature)
            t = targets[s:s + chunk, None]
            out[s:s + chunk] = logits.gather(1, t).squeeze(1) - torch.logsumexp(logits, dim=1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        acc = _at_least_float32(weight.dtype)
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, t = hidden[s:s + chunk], targets[s:s + chunk, None]
            g = _chunk_logits(h, weight, bias, temperature)
            g.sub_(torch.logsumexp(g, dim=1, keepdim=True)).exp_().neg_()  # -softmax
            g.scatter_add_(1, t, torch.ones_like(t, dtype=g.dtype))  # onehot - softmax
            g.mul_((grad[s:s + chunk] / temperature).unsqueeze(1))  # d loss / d raw logits
            g = g.to(weight.dtype)
            if need_h:
                gh[s:s + chunk] = g @ weight
            if need_w:
                if gw.dtype == g.dtype:
                    gw.addmm_(g.t(), h)
                else:
                    gw.add_((g.t() @ h).to(acc))
            if need_b:
                gb.add_(g.to(acc).sum(dim=0))
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                           temperature: float = 1.0, *, bias: Optional[torch.Tensor] = None,
                           chunk_size: int = 512) -> torch.Tensor:
    """`token_logprobs` of the logits ``hidden @ weight.T + bias`` (an LM head) without
    a ``[B, T, V]`` tensor: at most ``chunk_size`` tokens' logits exist at once, in
    the forward and in the backward (which recomputes them).

    Example (the same numbers as `token_logprobs` of the full logits):
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w = torch.randn(2, 5, 4, generator=g), torch.randn(11, 4, generator=g)
        >>> ids = torch.randint(0, 11, (2, 5), generator=g)
        >>> full = token_logprobs(h @ w.T, ids, 0.7)
        >>> torch.allclose(chunked_token_logprobs(h, w, ids, 0.7, chunk_size=3), full, atol=1e-6)
        True
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_token_logprobs(chunk_size={chunk_size!r}) must be an integer >= 1")
    rows, width, size = hidden.shape
    flat = hidden[:, :-1].reshape(-1, size)
    picked = _ChunkedLogprobs.apply(flat, weight, bias, input_ids[:, 1:].reshape(-1), float(temperature), chunk_size)
    return torch.nn.functional.pad(picked.view(rows, width - 1), (1, 0))


KL_ESTIMATORS = ("k1", "k3")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens.

    Example:
        >>> lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
        >>> kl_penalty(lp, ref, "k1"), kl_penalty(lp, ref, "k3")   # 1; e^-1 + 1 - 1
        (tensor([1.]), tensor([0.3679]))
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":  # clamped as verl's low_var_kl: a peaked policy cannot blow the loss up
        delta = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(delta) - delta - 1, -KL_CLAMP, KL_CLAMP)
    raise ValueError(f"kl_estimator {estimator!r} must be one of {KL_ESTIMATORS}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: int, num_seqs: int) -> torch.Tensor:
    """This rank's share of the minibatch loss: ``token-mean`` sums masked
    values over ``num_tokens`` (the minibatch's tokens, all ranks);
    ``seq-mean-token-mean`` sums each row's token mean over ``num_seqs``."""
    if mode == "token-mean":
        return (values * mask).sum() / max(num_tokens, 1)
    if mode == "seq-mean-token-mean":
        per_row = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_row.sum() / max(num_seqs, 1)
    raise ValueError(f"loss_agg {mode!r} must be one of {LOSS_AGGREGATIONS}")


def importance_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old - engine), cap)`` per token (no gradient)."""
    return torch.exp(old_logprobs - engine_logprobs).clamp(max=cap).detach()


# Statistics of `policy_loss` that ranks add up (their shares of minibatch means), and the two extremes.
ADDITIVE_STATS = ("pg_loss", "kl", "clipfrac", "clipfrac_low", "clipfrac_high", "clipfrac_dual", "ratio_mean",
                  "approx_kl")
EXTREME_STATS = ("ratio_min", "ratio_max")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, num_tokens: int, num_seqs: int = 1, clip_low: float = 0.2,
                clip_high: Optional[float] = None, clip_ratio_c: Optional[float] = 3.0, loss_agg: str = "token-mean",
                weights: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
                kl_coef: float = 0.0, kl_estimator: str = "k3") -> tuple[torch.Tensor, dict]:
    """The GRPO loss of these rows (see the module doc) and its statistics.

    Statistics, as verl logs them: ``pg_loss`` and ``kl`` (aggregated as the
    loss); token means of ``clipfrac`` (the clipped branch was taken: verl's
    ``pg_clipfrac``), split into ``clipfrac_high`` (``A > 0``, ratio above
    ``1 + clip_high``) and ``clipfrac_low`` (``A < 0``, ratio below ``1 - clip_low``),
    ``clipfrac_dual`` (``A < 0`` and the dual clip bound it: verl's
    ``pg_clipfrac_lower``), ``ratio_mean`` and ``approx_kl`` (``mean(logp_old -
    logp)``: verl's ``ppo_kl``), all summed over ``num_tokens`` so that ranks add
    up; and ``ratio_min`` / ``ratio_max`` over the masked tokens (inf / -inf if none).

    Example (one token, ratio e, advantage 1: clipped at 1 + 0.2):
        >>> loss, _ = policy_loss(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([1.0]),
        ...                       torch.tensor([[0.0, 1.0]]), num_tokens=1)
        >>> round(loss.item(), 4)
        -1.2
    """
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = advantages.unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(pg)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        dual = ((adv < 0) & (pg > bound)).to(pg.dtype)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    if weights is not None:
        pg = pg * weights
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator)
        if kl_coef:
            per_token = pg + kl_coef * kl
    loss = aggregate(per_token, mask, loss_agg, num_tokens, num_seqs)
    with torch.no_grad():
        took_clip = (clipped > unclipped).to(pg.dtype)

        def token_mean(values):
            return aggregate(values, mask, "token-mean", num_tokens, num_seqs)

        live = mask > 0
        stats = {"pg_loss": aggregate(pg, mask, loss_agg, num_tokens, num_seqs),
                 "kl": aggregate(kl, mask, loss_agg, num_tokens, num_seqs) if kl is not None
                 else torch.zeros((), device=loss.device),
                 "clipfrac": token_mean(took_clip),
                 "clipfrac_low": token_mean(took_clip * (adv < 0)),
                 "clipfrac_high": token_mean(took_clip * (adv > 0)),
                 "clipfrac_dual": token_mean(dual),
                 "ratio_mean": token_mean(ratio),
                 "approx_kl": token_mean(old_logprobs - logprobs),
                 "ratio_min": torch.where(live, ratio, torch.full_like(ratio, math.inf)).min(),
                 "ratio_max": torch.where(live, ratio, torch.full_like(ratio, -math.inf)).max()}
    return loss, stats


def minibatches(num_rows: int, world_size: int, num_minibatches: int, *, seed: int,
                epoch: int) -> list[list[list[int]]]:
    """Which rows each rank trains on in each minibatch of one epoch:
    ``out[j][r]`` = the batch rows of rank ``r`` in minibatch ``j``.

    Rank ``r`` owns rows ``r, r + W, r + 2W, ...`` (its forward passes and cached
    log-probs stay with it); every epoch shuffles the positions, the same way on
    every rank, and cuts them into ``num_minibatches`` equal parts. ``num_rows``
    must be a multiple of ``world_size * num_minibatches`` (`Batch.padded`).

    Example:
        >>> minibatches(8, 2, 2, seed=0, epoch=0)   # 2 minibatches x 2 ranks x 2 rows
        [[[0, 2], [1, 3]], [[6, 4], [7, 5]]]
    """
    if num_rows % (world_size * num_minibatches):
        raise ValueError(f"{num_rows} rows do not split into {world_size} ranks x {num_minibatches} minibatches; "
                         "pad the batch (Batch.padded)")
    local = num_rows // world_size
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(local, generator=g).tolist()
    size = local // num_minibatches
    return [[[r + world_size * p for p in order[j * size:(j + 1) * size]] for r in range(world_size)]
            for j in range(num_minibatches)]
