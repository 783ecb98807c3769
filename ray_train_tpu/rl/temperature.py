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
    offset = torch.nn.functional.pad(temperature_offset(logits[:, :-1], temperature), (1, 0))
    out = raw_logprobs / temperature + offset
    out[:, 0] = 0.0
    return out if mask is None else torch.where(mask > 0, out, torch.zeros_like(out))


def engine_logprobs_at_temperature(model, rows, temperature: float, micro_batch_size: Optional[int] = None):
    """`rows` (a `grpo.Batch`) with its ``engine_logprobs`` (raw) turned into the
    sampler's at `temperature`, the offset from `model`'s logits (one forward
    pass without gradient, ``micro_batch_size`` rows at a time). Unchanged at T = 1."""
    if temperature == 1.0:
        return rows
    step = micro_batch_size or rows.num_rows
    parts = []
    with torch.no_grad():
        for start in range(0, rows.num_rows, step):
            part = rows.rows(slice(start, start + step))
            logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
            parts.append(tempered_logprobs(part.engine_logprobs, logits, temperature, part.loss_mask))
            del logits
    return dataclasses.replace(rows, engine_logprobs=torch.cat(parts))
