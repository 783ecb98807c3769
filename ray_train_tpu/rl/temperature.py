"""The sampler's log-probs at the sampling temperature, from an engine's raw ones.

vllm-torchtpu reports the log-probs of the logits before temperature
(``TPUModelRunner.gather_logprobs``; vLLM's ``logprobs_mode="raw_logprobs"``,
whatever the engine was asked: `ray_train_tpu.serve._torchtpu_rules`), while
the tokens were drawn from ``softmax(logits / T)``. With ``lp = l_x - LSE(l)``
the raw log-prob of token x,

    log softmax(l / T)_x = lp / T + LSE(l) / T - LSE(l / T),

and the offset ``LSE(l) / T - LSE(l / T)`` depends on the whole distribution,
which the engine does not send. The trainer computes it from its own logits
(the same weights: parity after every sync), so the importance weight
``exp(logp_old - logp_engine)`` and ``old_logprobs="engine"`` compare
log-probs at the same temperature. At T = 1 the raw log-probs are the sampler's.

Given the model's LM head (an ``nn.Linear`` whose output is the model's logits,
as `PolicyWorker` checks), the offset is computed inside the head, a chunk of
tokens at a time (as `grpo.chunked_token_logprobs`): no ``[B, T, V]`` tensor
exists, at most one float32 ``[chunk, V]``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


def temperature_offset(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``LSE(l) / T - LSE(l / T)`` over the last axis, in float32."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1) / temperature - torch.logsumexp(x / temperature, dim=-1)


def tempered_logprobs(raw_logprobs: torch.Tensor, logits: torch.Tensor, temperature: float,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T]`` log-probs under ``softmax(logits / temperature)`` from raw ones
    (``raw_logprobs[:, t]``: token t's, from the logits at ``t - 1``, as
    `ray_train_tpu.rl.grpo.token_logprobs` places them; position 0 and, with
    `mask`, positions outside it stay 0)."""
    if temperature == 1.0:
        return raw_logprobs
    return _tempered(raw_logprobs, temperature_offset(logits, temperature), temperature, mask)


def _tempered(raw_logprobs, offsets, temperature: float, mask):
    """``offsets[:, t]``: of the logits at position t, which give token t + 1's log-prob."""
    out = raw_logprobs / temperature + torch.nn.functional.pad(offsets[:, :-1], (1, 0))
    out[:, 0] = 0.0
    return out if mask is None else torch.where(mask > 0, out, torch.zeros_like(out))


def chunked_temperature_offset(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, *,
                               bias: Optional[torch.Tensor] = None, chunk_size: int = 512) -> torch.Tensor:
    """`temperature_offset` of the logits ``hidden @ weight.T + bias`` ([..., H] ->
    [...]), ``chunk_size`` tokens' logits at a time.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w = torch.randn(2, 5, 4, generator=g), torch.randn(11, 4, generator=g)
        >>> full = temperature_offset(h @ w.T, 0.7)
        >>> torch.allclose(chunked_temperature_offset(h, w, 0.7, chunk_size=3), full, atol=1e-6)
        True
    """
    from ray_train_tpu.rl.grpo import _chunk_logits

    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
    for s in range(0, flat.shape[0], chunk_size):
        out[s:s + chunk_size] = temperature_offset(_chunk_logits(flat[s:s + chunk_size], weight, bias, 1.0),
                                                   temperature)
    return out.view(hidden.shape[:-1])


def _offsets_through_head(model, head, part, temperature: float, chunk_size: int) -> torch.Tensor:
    """One model forward whose LM head returns each position's offset [B, T] instead
    of its logits (the module and its hooks stay; only ``forward`` changes)."""
    head.forward = lambda hidden: chunked_temperature_offset(hidden, head.weight, temperature, bias=head.bias,
                                                             chunk_size=chunk_size)
    try:
        return model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
    finally:
        del head.forward  # back to the class's


def engine_logprobs_at_temperature(model, rows, temperature: float, micro_batch_size: Optional[int] = None, *,
                                   head: Optional[torch.nn.Linear] = None, chunk_size: Optional[int] = None):
    """`rows` (a `grpo.Batch`) with its ``engine_logprobs`` (raw) turned into the
    sampler's at `temperature`, the offset from `model`'s logits (one forward
    pass without gradient, ``micro_batch_size`` rows at a time). With `head` (the
    model's LM head, whose output is the model's logits) and `chunk_size`, the
    offset is computed inside the head, ``chunk_size`` tokens at a time, without
    the model's ``[B, T, V]`` logits. Unchanged at T = 1."""
    if temperature == 1.0:
        return rows
    step = micro_batch_size or rows.num_rows
    parts = []
    with torch.no_grad():
        for start in range(0, rows.num_rows, step):
            part = rows.rows(slice(start, start + step))
            if head is not None and chunk_size:
                offsets = _offsets_through_head(model, head, part, temperature, chunk_size)
            else:
                offsets = temperature_offset(model(input_ids=part.input_ids,
                                                   attention_mask=part.attention_mask).logits, temperature)
            parts.append(_tempered(part.engine_logprobs, offsets, temperature, part.loss_mask))
            del offsets
    return dataclasses.replace(rows, engine_logprobs=torch.cat(parts))
