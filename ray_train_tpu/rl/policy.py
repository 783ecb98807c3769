"""The trainer: the policy sharded with FSDP2 over every device of its slice.

Why plain Ray actors joined by `ray_train_tpu.setup_process_group`, not
`TPUTorchTrainer` workers: GRPO is driven step by step from one controller
(rollout, rewards, a train step, a weight sync, a parity check), and each
phase needs a call *into* the trainer and an answer back (metrics,
object-store references to the new weights, digests). Ray Train's workers run
one function to the end and only report out. With actors the driver owns the
loop, times each phase, and replaces the trainer group after a failure while
the engines keep running. The process group and the TorchTPU environment are
the ones Ray Train workers get (``setup_process_group`` runs the same backend).

Data crosses process boundaries on the host: a batch arrives from the object
store as host tensors and is moved to `ray_train_tpu.get_device()` here;
metrics leave as Python numbers; weights are cast and copied to the host
before they are put in the object store. Each rank trains on rows
``rank::world_size`` of the batch (see `grpo.minibatches`).
"""

from __future__ import annotations

import logging
from typing import Optional

from ray_train_tpu.rl.config import AlgorithmConfig

logger = logging.getLogger(__name__)

# What `PolicyWorker.train` reports, summed over ranks (`grpo.ADDITIVE_STATS` between loss and the last two).
_SUMMED = ("loss", "pg_loss", "kl", "clipfrac", "clipfrac_low", "clipfrac_high", "clipfrac_dual", "ratio_mean",
           "approx_kl", "logprob_gap", "importance_weight")


def _local(param):
    """This rank's part of a parameter (FSDP2 holds DTensors sharded on dim 0)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _logprob_forward(head, input_ids, temperature: float, chunk: int):
    """A forward for a causal LM's output head (an ``nn.Linear``), set on the module
    for one model forward: it returns the token log-probs of ``input_ids`` [B, T]
    (`grpo.chunked_token_logprobs`) instead of [B, T, V] logits. The module and its
    hooks stay in place (FSDP2 follows which modules ran), only ``forward`` changes."""
    from ray_train_tpu.rl.grpo import chunked_token_logprobs

    def forward(hidden):
        return chunked_token_logprobs(hidden, head.weight, input_ids, temperature, bias=head.bias, chunk_size=chunk)

    return forward


def _output_head(model):
    """(attribute name, module) of the model's LM head if it is a plain ``nn.Linear`` child, else None."""
    import torch

    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(out) is not torch.nn.Linear:
        return None
    return next(((name, child) for name, child in model.named_children() if child is out), None)


def _chunks(index, size: Optional[int]):
    size = size or len(index) or 1
    return [index[i:i + size] for i in range(0, len(index), size)]


class PolicyWorker:
    """One rank of the trainer (a Ray actor holding one TPU device).

    Call `build` once the process group exists, then `score` (KL in the reward
    only), `train`, `publish_weights`, `shard_digests`, `save` and `load` on
    every rank.
    """

    def __init__(self, model_dir: str, *, lr: float, seed: int, algorithm: AlgorithmConfig,
                 max_grad_norm: float = 1.0, temperature: float = 1.0, num_threads: int = 1,
                 param_dtype: str = "float32"):
        self.model_dir, self.lr, self.seed, self.algorithm = model_dir, lr, seed, algorithm
        self.param_dtype = param_dtype  # the master weights: float32 (float64 in numerical tests)
        self.max_grad_norm, self.temperature, self.num_threads = max_grad_norm, temperature, num_threads
        self.model = self.reference = self.optimizer = None
        self._cache: dict = {}  # step -> (old log-probs, reference log-probs) of this rank's rows
        self._published: Optional[tuple] = None  # (rank, [bucket ObjectRefs])
        self._heads: dict = {}  # id(model) -> (name, LM head) where the chunked log-prob head is used

    # --- set-up

    def _load(self, trainable: bool):
        import torch
        from transformers import AutoModelForCausalLM

        from ray_train_tpu.prepare import prepare_model
        from ray_train_tpu.strategies.fsdp2 import FSDP2Strategy

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.param_dtype))
        chunked = bool(self.algorithm.logprob_chunk) and self._chunked_head_matches(model)
        # One fully_shard per decoder layer (Hugging Face names them in _no_split_modules), then the root.
        names = set(getattr(model, "_no_split_modules", None) or [])
        layers = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
        model = prepare_model(model, strategy=FSDP2Strategy(shard_modules=layers or None))
        model.train(trainable)
        if not trainable:
            model.requires_grad_(False)
        if chunked:
            self._heads[id(model)] = _output_head(model)
        return model

    def build(self) -> dict:
        import torch
        import torch.distributed as dist

        from ray_train_tpu.device import get_device

        torch.set_num_threads(self.num_threads)  # simulated chips share the machine's cores
        torch.manual_seed(self.seed)
        self.device = get_device()
        self.model = self._load(trainable=True)
        if self.algorithm.needs_reference:
            self.reference = self._load(trainable=False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        return {"rank": self.rank, "world_size": self.world_size,
                "num_params": sum(p.numel() for p in self.model.parameters())}

    # --- log-probs

    def _logprobs(self, model, rows, head=None):
        from ray_train_tpu.rl.grpo import token_logprobs

        head = head or self._heads.get(id(model))
        if head is None:
            logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
            return token_logprobs(logits, rows.input_ids, self.temperature)
        module = head[1]
        module.forward = _logprob_forward(module, rows.input_ids, self.temperature, self.algorithm.logprob_chunk)
        try:
            return model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits
        finally:
            del module.forward  # back to the class's

    def _chunked_head_matches(self, model) -> bool:
        """Whether ``model`` (on the host, before sharding) returns exactly what its
        head computes, so that the chunked log-prob head may stand in for it (checked
        on one short sequence; a model that post-processes its logits, e.g. with a
        soft cap, keeps the naive path)."""
        import torch

        from ray_train_tpu.rl.grpo import Batch

        head = _output_head(model)
        if head is None:
            logger.warning("the model's output head is not an nn.Linear child: log-probs from its whole logits")
            return False
        ids = (torch.arange(16) * 7919 % head[1].weight.shape[0]).reshape(1, 16)
        zeros = torch.zeros(1, 16)
        rows = Batch(ids, torch.ones_like(ids), zeros, torch.zeros(1), zeros)
        with torch.no_grad():
            naive = self._logprobs(model, rows)
            chunked = self._logprobs(model, rows, head=head)
        if torch.allclose(naive, chunked, rtol=1e-4, atol=1e-4):
            return True
        logger.warning("the model's logits are not its head's output (max difference %.3g): log-probs from its whole "
                       "logits", (naive - chunked).abs().max().item())
        return False

    def _score_rows(self, local, need_old: bool, need_ref: bool):
        """Old and reference log-probs of this rank's rows (no gradient), in micro-batches."""
        import torch

        old, ref = [], []
        with torch.no_grad():
            for idx in _chunks(list(range(local.num_rows)), self.algorithm.micro_batch_size):
                rows = local.rows(idx)
                if need_old:
                    old.append(self._logprobs(self.model, rows))
                if need_ref:
                    ref.append(self._logprobs(self.reference, rows))
        return (torch.cat(old) if old else None), (torch.cat(ref) if ref else None)

    def _local_rows(self, batch):
        return batch.rows(slice(self.rank, None, self.world_size)).to(self.device)

    def score(self, batch, step: int) -> list[float]:
        """Per row of this rank, the summed KL to the reference over its
        completion tokens (for ``kl_in="reward"``); keeps the log-probs for `train`."""
        from ray_train_tpu.rl.grpo import kl_penalty

        a = self.algorithm
        local = self._local_rows(batch)
        old, ref = self._score_rows(local, need_old=True, need_ref=True)
        self._cache = {step: (old, ref)}
        kl = (kl_penalty(old, ref, a.kl_estimator) * local.loss_mask).sum(dim=1)
        return kl.cpu().tolist()

    # --- the update

    def train(self, batch, step: int) -> dict:
        """``ppo_epochs x num_minibatches`` optimizer steps on this rank's rows of
        ``batch`` (a padded host `grpo.Batch`); returns the batch's statistics."""
        import torch

        from ray_train_tpu.rl.grpo import importance_weights, minibatches

        a = self.algorithm
        local = self._local_rows(batch)
        if self.temperature != 1.0:  # engine log-probs are of the raw logits (vllm-torchtpu): see rl.temperature
            from ray_train_tpu.rl.temperature import engine_logprobs_at_temperature

            head = self._heads.get(id(self.model))  # the chunked head, where it stands for the model's logits
            local = engine_logprobs_at_temperature(self.model, local, self.temperature, a.micro_batch_size,
                                                   head=head[1] if head else None, chunk_size=a.logprob_chunk)
        single = a.updates_per_batch == 1 and a.old_logprobs == "policy"
        old, ref = self._cache.pop(step, (None, None))
        need_ref = self.reference is not None and a.kl_in == "loss" and ref is None
        if old is None and a.old_logprobs == "policy" and not single or need_ref:
            need_old = old is None and a.old_logprobs == "policy" and not single
            fresh_old, fresh_ref = self._score_rows(local, need_old=need_old, need_ref=need_ref)
            old = old if fresh_old is None else fresh_old
            ref = ref if fresh_ref is None else fresh_ref
        if a.old_logprobs == "engine":
            old = local.engine_logprobs
        if a.kl_in == "reward":
            ref = None  # KL went into the rewards
        host_mask = batch.loss_mask
        totals, extremes = [], []
        for epoch in range(a.ppo_epochs):
            for parts in minibatches(batch.num_rows, self.world_size, a.num_minibatches, seed=self.seed * 7919 + step,
                                     epoch=epoch):
                every = [row for rank_rows in parts for row in rank_rows]
                counts = (int(host_mask[every].sum().item()), int((host_mask[every].sum(dim=1) > 0).sum().item()))
                mine = [(row - self.rank) // self.world_size for row in parts[self.rank]]
                total, extreme = self._update(local, mine, old, ref, counts, single, importance_weights)
                totals.append(total)
                extremes.append(extreme)
        return self._statistics(torch.stack(totals), torch.stack(extremes), a.ppo_epochs)

    def _statistics(self, totals, extremes, epochs: int) -> dict:
        """The batch's statistics from each update's (``totals``: this rank's shares of
        the minibatch means, then the global grad norm; ``extremes``: the smallest
        ratio and minus the largest): their means over all updates, and per PPO epoch
        (``"epochs"``: one dict per epoch, as verl logs each mini-batch's)."""
        import torch
        import torch.distributed as dist

        shares = totals[:, :-1].contiguous()
        dist.all_reduce(shares)  # every rank's share of each minibatch; grad norm is global already
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        totals = torch.cat([shares, totals[:, -1:]], dim=1)

        def summary(t, e) -> dict:
            out = dict(zip(_SUMMED + ("grad_norm",), t.mean(dim=0).cpu().tolist()))
            low, minus_high = e.min(dim=0).values.cpu().tolist()
            return {**out, "ratio_min": low, "ratio_max": -minus_high}

        per = totals.shape[0] // epochs
        return {**summary(totals, extremes), "updates": int(totals.shape[0]),
                "epochs": [summary(totals[k * per:(k + 1) * per], extremes[k * per:(k + 1) * per])
                           for k in range(epochs)]}

    def _update(self, local, mine: list, old, ref, counts: tuple, single: bool, importance_weights):
        """One optimizer step over this rank's rows ``mine`` of a minibatch."""
        import torch

        from ray_train_tpu.rl.grpo import ADDITIVE_STATS, aggregate, policy_loss

        a, w = self.algorithm, self.world_size
        num_tokens, num_seqs = counts
        self.optimizer.zero_grad(set_to_none=True)
        acc = torch.zeros(len(_SUMMED), device=self.device)
        extreme = torch.full((2,), float("inf"), device=self.device)  # min ratio, -max ratio
        for idx in _chunks(mine, a.micro_batch_size):
            rows = local.rows(idx)
            lp = self._logprobs(self.model, rows)
            old_lp = lp.detach() if single else old[idx]
            weights = None
            if a.old_logprobs == "policy" and a.importance_cap is not None:
                weights = importance_weights(old_lp, rows.engine_logprobs, a.importance_cap)
            loss, st = policy_loss(lp, old_lp, rows.advantages, rows.loss_mask, num_tokens=num_tokens,
                                   num_seqs=num_seqs, clip_low=a.clip_eps, clip_high=a.clip_high,
                                   clip_ratio_c=a.clip_ratio_c, loss_agg=a.loss_agg, weights=weights, kl_coef=a.kl_coef,
                                   ref_logprobs=None if ref is None else ref[idx], kl_estimator=a.kl_estimator)
            (loss * w).backward()
            gap = aggregate((old_lp - rows.engine_logprobs).abs(), rows.loss_mask, "token-mean", num_tokens, 1)
            iw = aggregate(weights if weights is not None else torch.ones_like(lp), rows.loss_mask, "token-mean",
                           num_tokens, 1)
            acc += torch.stack([loss.detach(), *(st[k] for k in ADDITIVE_STATS), gap, iw])
            extreme = torch.minimum(extreme, torch.stack([st["ratio_min"], -st["ratio_max"]]))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.optimizer.step()
        return torch.cat([acc, grad_norm.detach().reshape(1).to(acc.dtype)]), extreme

    # --- weights

    def publish_weights(self, dtype: str, bucket_bytes: int) -> dict:
        """Cast this rank's shard of every parameter to ``dtype`` on the host and
        put it in Ray's object store in buckets (`weights.plan_buckets`, the same
        on every rank). No collective. Returns ``{"refs": [bucket ObjectRefs],
        "rows": {name: rows of this rank's shard}}``."""
        import ray
        import torch

        from ray_train_tpu.rl import weights as W

        cast = getattr(torch, dtype)
        params = dict(self.model.named_parameters())
        size = torch.tensor([], dtype=cast).element_size()
        plan = W.plan_buckets([(n, p.numel() * size) for n, p in params.items()], bucket_bytes)
        refs = []
        for names in plan:
            host = [(n, _local(params[n]).detach().to(device="cpu", dtype=cast, copy=True)) for n in names]
            refs.append(ray.put(W.pack(host)))
        self._published = (self.rank, refs)
        return {"refs": refs, "rows": {n: _local(p).shape[0] for n, p in params.items()}}

    def shard_digests(self, layout: dict, specs: Optional[dict] = None) -> dict:
        """Digests of what this rank published last, cut into the engines' blocks."""
        import ray

        from ray_train_tpu.rl import weights as W

        if self._published is None:
            return {}
        shard, refs = self._published
        tensors = dict(t for bucket in ray.get(refs) for t in W.unpack(bucket))
        return W.trainer_digests(shard, tensors, layout, specs)

    def source_mismatches(self, layout: dict) -> list[str]:
        """Where this rank's shard of the weights differs, bit for bit, from the
        tensors of ``model_dir``, cast to the trainer's dtype as ``from_pretrained``
        casts them: one line per parameter, [] when the rank holds exactly those
        weights. ``layout``: ``{name: rows of each rank's shard}`` (what
        `publish_weights` reports). Reads only this rank's rows of each tensor
        (safetensors slices), so the ranks together read the model once."""
        import contextlib

        from safetensors import safe_open

        from ray_train_tpu.rl.weights import safetensors_files, same_bits

        files = safetensors_files(self.model_dir)
        out = []
        with contextlib.ExitStack() as stack:
            handles = {}
            for name, param in self.model.named_parameters():
                mine = _local(param).detach().to("cpu")
                if name not in files:
                    out.append(f"{name}: not in {self.model_dir}")
                    continue
                if files[name] not in handles:
                    handles[files[name]] = stack.enter_context(safe_open(files[name], framework="pt"))
                start = sum(layout[name][:self.rank])
                want = handles[files[name]].get_slice(name)[start:start + mine.shape[0]].to(mine.dtype)
                if not same_bits(mine, want):
                    out.append(f"{name}: rank {self.rank}'s rows {start}..{start + mine.shape[0] - 1} differ")
        return out

    # --- checkpoints

    def save(self, root: str, name: str, step: int) -> None:
        """A checkpoint of every rank in ``root/name`` (a shared path or a URI: `rl.storage`)."""
        from ray_train_tpu.rl import storage

        storage.save(root, name, model=self.model, optimizer=self.optimizer, step=step)

    def load(self, directory: str) -> int:
        from ray_train_tpu.rl import storage

        return storage.load(directory, model=self.model, optimizer=self.optimizer)

    def pid(self) -> int:
        import os

        return os.getpid()
