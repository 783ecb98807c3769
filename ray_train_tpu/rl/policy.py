"""The trainer: the policy sharded with FSDP2 over every chip of slice A.

Why plain Ray actors joined by `ray_train_tpu.setup_process_group`, not
`TPUTorchTrainer` workers: GRPO is driven step by step from one controller
(rollout on slice B, rewards, a train step, a weight sync, a parity check),
and each phase needs a call *into* the trainer and an answer back (metrics,
an object-store reference to the new weights, digests). Ray Train's workers run
one function to the end and only report out, so the loop would have to live
inside rank 0 and reach the engine from there. With actors the driver owns the
loop, times each phase, and replaces the trainer group after a failure while
the rollout engine keeps running. The process group and the TorchTPU
environment are the same ones Ray Train workers get (``setup_process_group``
runs the same backend), and it spans slice A only.

Each step every rank takes rows ``rank::world_size`` of the batch; the loss is
scaled so that FSDP2's gradient average equals the token mean of the whole
batch. After the optimizer step, `PolicyWorker.publish_weights` puts each rank's
own shard of the weights, cast to the engine's dtype, in Ray's object store (no
collective; or, with ``mode="full"``, rank 0's gathered full state dict).
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)


def _local(param):
    """This rank's part of a parameter (FSDP2 holds DTensors sharded on dim 0)."""
    return param.to_local() if hasattr(param, "to_local") else param


class PolicyWorker:
    """One rank of the trainer (a Ray actor holding ``{"TPU": 1}`` on slice A).

    Call `build` once the process group exists, then `train_step`,
    `publish_weights`, `shard_digests`, `save` and `load` on every rank.
    """

    def __init__(self, model_dir: str, *, lr: float, seed: int, max_grad_norm: float = 1.0,
                 clip_eps: float = 0.2, num_threads: int = 1):
        self.model_dir, self.lr, self.seed = model_dir, lr, seed
        self.max_grad_norm, self.clip_eps, self.num_threads = max_grad_norm, clip_eps, num_threads
        self.model = self.optimizer = None
        self._published: Optional[dict] = None

    def build(self) -> dict:
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from ray_train_tpu.prepare import prepare_model
        from ray_train_tpu.strategies.fsdp2 import FSDP2Strategy

        torch.set_num_threads(self.num_threads)  # chips share two cores in simulation
        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        # One fully_shard per decoder layer (Hugging Face names them in _no_split_modules), then the root.
        layer_names = set(getattr(model, "_no_split_modules", None) or [])
        layers = tuple({type(m) for m in model.modules() if type(m).__name__ in layer_names})
        strategy = FSDP2Strategy(shard_modules=layers or None)
        self.model = prepare_model(model, strategy=strategy)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        return {"rank": self.rank, "world_size": self.world_size,
                "num_params": sum(p.numel() for p in self.model.parameters())}

    def train_step(self, batch, num_tokens: int) -> dict:
        """One GRPO optimizer step on this rank's rows of ``batch`` (a `grpo.Batch`)."""
        import torch
        import torch.distributed as dist

        from ray_train_tpu.rl.grpo import grpo_loss, token_logprobs

        rows = batch.rows(slice(self.rank, None, self.world_size))
        logits = self.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        logprobs = token_logprobs(logits, rows.input_ids)
        # One optimizer step per batch of rollouts: the policy that sampled is this one (ratio 1).
        loss = grpo_loss(logprobs, logprobs.detach(), rows.advantages, rows.loss_mask, num_tokens,
                         self.clip_eps) * self.world_size
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        mask = rows.loss_mask
        stats = torch.stack([
            loss.detach() / self.world_size,
            ((logprobs.detach() - rows.engine_logprobs).abs() * mask).sum() / max(num_tokens, 1),
        ])
        dist.all_reduce(stats)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return {"loss": stats[0].item(), "logprob_gap": stats[1].item(), "grad_norm": float(grad_norm)}

    def publish_weights(self, dtype: str, mode: str = "shards") -> Optional[list]:
        """Put this rank's weights, cast to ``dtype``, in Ray's object store and
        return ``[ObjectRef]`` (wrapped, so that Ray passes the reference on).

        ``"shards"``: every rank its own FSDP2 shard of every parameter (dim 0,
        Hugging Face names), no collective; the engine concatenates them in rank
        order. ``"full"``: the full state dict gathered to rank 0 (a collective on
        every rank; the other ranks return None).
        """
        import ray
        import torch

        cast = getattr(torch, dtype)
        if mode == "shards":
            local = {n: _local(p).detach().to(cast).contiguous() for n, p in self.model.named_parameters()}
            self._published = (self.rank, local)
        elif mode == "full":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank != 0:
                self._published = None
                return None
            named = {n for n, _ in self.model.named_parameters()}  # tied duplicates and buffers stay behind
            self._published = (0, {k: v.to(cast).contiguous() for k, v in full.items() if k in named})
        else:
            raise ValueError(f"publish_weights(mode={mode!r}) must be 'shards' or 'full'")
        return [ray.put(self._published[1])]

    def shard_digests(self) -> dict:
        """``{"<name>#<shard>": digest}`` of what this rank published last ({} if nothing)."""
        from ray_train_tpu.rl.weights import digest, shard_key

        if self._published is None:
            return {}
        shard, tensors = self._published
        return {shard_key(n, shard): digest(t) for n, t in tensors.items()}

    def save(self, directory: str, step: int) -> None:
        from ray_train_tpu import checkpoint

        checkpoint.save(directory, model=self.model, optimizer=self.optimizer, step=step)

    def load(self, directory: str) -> int:
        from ray_train_tpu import checkpoint

        return checkpoint.load(directory, model=self.model, optimizer=self.optimizer).step

    def pid(self) -> int:
        import os

        return os.getpid()
