"""What a GRPO run is: `GRPOConfig` with its `AlgorithmConfig` and `SamplingConfig`.

Pure: no torch, no Ray, no vLLM; every field is checked at construction and a
bad one raises ``ValueError``/``TypeError`` naming the field, the value, the
rule and the fix. The defaults are the GRPO of the DeepSeekMath paper as verl
runs it (one optimizer step per rollout batch, token-mean loss, no KL); the
docs page ``docs/rl.md`` lists every option.

Example:
    >>> algo = AlgorithmConfig(ppo_epochs=2, num_minibatches=4, clip_eps_high=0.28)
    >>> algo.updates_per_batch, algo.clip_high
    (8, 0.28)
    >>> AlgorithmConfig(kl_estimator="k2")
    Traceback (most recent call last):
    ...
    ValueError: AlgorithmConfig(kl_estimator='k2') must be one of 'k1', 'k3', got 'k2'; k1 = logp - logp_ref, k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Optional

from ray_train_tpu import _validate as V

OLD_LOGPROBS = ("policy", "engine")
KL_ESTIMATORS = ("k1", "k3")
KL_IN = ("loss", "reward")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
ON_REWARD_ERROR = ("raise", "skip")
ADVANTAGE_STDS = ("sample", "population", "none")


def _check_fraction(where: str, field: str, value: Any, *, fix: str) -> float:
    return V.check_number(where, field, value, positive=True, max=1.0, fix=fix)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How completions are drawn: ``n`` per prompt (the GRPO group),
    ``temperature``, ``max_tokens``. The trainer scores tokens with the same
    temperature, and the engine reports the log-probs it sampled from."""

    n: int = 8
    temperature: float = 1.0
    max_tokens: int = 256

    def __post_init__(self):
        V.check_int("SamplingConfig", "n", self.n, min=2, why="GRPO compares the samples of a prompt",
                    fix="e.g. n=8")
        V.check_number("SamplingConfig", "temperature", self.temperature, max=10.0,
                       fix="sampling needs temperature > 0 (greedy decoding gives a group no spread)")
        V.check_int("SamplingConfig", "max_tokens", self.max_tokens, min=1, fix="e.g. max_tokens=256")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The policy update (formulas: `ray_train_tpu.rl.grpo`).

    Args:
        std: the group's spread that divides the advantages (`grpo.group_advantages`):
            ``"sample"`` (Bessel-corrected, verl's and TRL's), ``"population"``, or
            ``"none"`` (only centred, Dr. GRPO).
        ppo_epochs: passes over each rollout batch.
        num_minibatches: optimizer steps per pass; ``ppo_epochs * num_minibatches``
            updates per batch (more than one makes the ratio leave 1 and the clip act).
        old_logprobs: ``"policy"``: the trainer's own log-probs before the batch's
            first update (one extra forward pass when there is more than one
            update), with the truncated importance weight for the sampler;
            ``"engine"``: the sampler's log-probs (no extra pass, no weight).
        importance_cap: truncation of ``exp(logp_old - logp_engine)`` (``"policy"``
            only; None: no importance weight).
        clip_eps, clip_eps_high: the ratio's clip range ``[1 - clip_eps, 1 + clip_eps_high]``
            (``clip_eps_high`` None: symmetric; > clip_eps: DAPO's clip-higher).
        clip_ratio_c: dual-clip PPO (Ye et al., 2019; verl's default 3.0): for a
            negative advantage the loss of a token is at most ``clip_ratio_c * |A|``,
            however large its ratio (None: no dual clip). Must be > 1.
        loss_agg: ``"token-mean"`` or ``"seq-mean-token-mean"``.
        kl_coef: weight of KL(policy || initial policy); 0: no reference model.
        kl_estimator: ``"k1"`` or ``"k3"``.
        kl_in: ``"loss"`` (a loss term) or ``"reward"`` (subtracted from each
            completion's reward, summed over its tokens, before the advantages).
        micro_batch_size: rows per forward/backward on a rank (gradients add up
            to the minibatch's); None: a rank's whole minibatch at once.
        logprob_chunk: tokens whose logits the trainer's LM head computes at once
            (`grpo.chunked_token_logprobs`, forward and backward): no ``[rows, T,
            vocab]`` float32 tensor exists; None: the model's whole logits (the
            naive path, a memory cliff at a 150k vocabulary).
    """

    std: str = "sample"
    ppo_epochs: int = 1
    num_minibatches: int = 1
    old_logprobs: str = "policy"
    importance_cap: Optional[float] = 2.0
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    clip_ratio_c: Optional[float] = 3.0
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"
    micro_batch_size: Optional[int] = None
    logprob_chunk: Optional[int] = 512

    def __post_init__(self):
        w = "AlgorithmConfig"
        V.check_choice(w, "std", self.std, ADVANTAGE_STDS,
                       fix="'sample' (verl's and TRL's), 'population', or 'none' (Dr. GRPO: only centred)")
        V.check_int(w, "ppo_epochs", self.ppo_epochs, min=1, max=100, fix="e.g. ppo_epochs=1")
        V.check_int(w, "num_minibatches", self.num_minibatches, min=1, max=4096, fix="e.g. num_minibatches=4")
        V.check_choice(w, "old_logprobs", self.old_logprobs, OLD_LOGPROBS,
                       fix="'policy' recomputes them before the update, 'engine' takes the sampler's")
        if self.importance_cap is not None:
            V.check_number(w, "importance_cap", self.importance_cap, fix="e.g. importance_cap=2.0, or None")
            if self.importance_cap < 1:
                raise V.fail(w, "importance_cap", self.importance_cap, ">= 1 (it truncates weights around 1)",
                             "e.g. importance_cap=2.0, or None for no importance weight")
        _check_fraction(w, "clip_eps", self.clip_eps, fix="e.g. clip_eps=0.2")
        if self.clip_eps_high is not None:
            V.check_number(w, "clip_eps_high", self.clip_eps_high, max=10.0, fix="e.g. clip_eps_high=0.28 (DAPO)")
        if self.clip_ratio_c is not None:
            V.check_number(w, "clip_ratio_c", self.clip_ratio_c, max=1e6, fix="e.g. clip_ratio_c=3.0, or None")
            if self.clip_ratio_c <= 1:
                raise V.fail(w, "clip_ratio_c", self.clip_ratio_c, "> 1 (it bounds the loss of a negative-advantage "
                             "token at clip_ratio_c * |A|)", "e.g. clip_ratio_c=3.0 (verl's), or None for no dual clip")
        V.check_choice(w, "loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        V.check_number(w, "kl_coef", self.kl_coef, positive=False, max=100.0, fix="e.g. kl_coef=0.001, or 0")
        V.check_choice(w, "kl_estimator", self.kl_estimator, KL_ESTIMATORS,
                       fix="k1 = logp - logp_ref, k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1")
        V.check_choice(w, "kl_in", self.kl_in, KL_IN, fix="'loss' adds it to the loss, 'reward' to the rewards")
        if self.micro_batch_size is not None:
            V.check_int(w, "micro_batch_size", self.micro_batch_size, min=1, fix="e.g. micro_batch_size=8, or None")
        if self.logprob_chunk is not None:
            V.check_int(w, "logprob_chunk", self.logprob_chunk, min=1, fix="e.g. logprob_chunk=512, or None for the "
                        "model's whole logits")

    @property
    def updates_per_batch(self) -> int:
        return self.ppo_epochs * self.num_minibatches

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0


@dataclasses.dataclass(kw_only=True)
class GRPOConfig:
    """Everything a GRPO run needs (see ``docs/rl.md`` for each field).

    Args:
        model_dir: a Hugging Face model directory, readable on every host.
        prompts: the records to train on: any iterable of dicts (a list, a
            generator), a Ray Dataset or a Hugging Face ``datasets.Dataset``.
            Each record has ``prompt_key`` (a string, or a list of chat messages)
            and any other fields, which `reward_fn` receives by name.
        reward_fn: ``reward_fn(prompt, completion, **fields) -> float``, run in
            Ray tasks (`reward_workers` of them per step).
        prompt_key: the record field holding the prompt.
        chat_template: apply the tokenizer's chat template to string prompts
            (None: when the tokenizer has one). Message lists always use it.
        num_prompts: prompts per step; ``sampling.n`` completions each.
        sampling, algorithm: see `SamplingConfig`, `AlgorithmConfig`.
        lr, max_grad_norm: AdamW's learning rate and the gradient clip.
        topology, accelerator_type: the trainer's slice (or, with
            ``one_slice=True``, the one slice both halves come from).
        rollout_topology: the rollout slice (default: the same as the trainer's).
        one_slice: trainer and engines on two halves of one slice.
        num_engines, tensor_parallel_size: vLLM engines on the rollout slice and
            devices per engine; their product must be the slice's devices
            (``num_engines`` None: as many as fill it).
        engine_dtype: the engines' weights; the trainer keeps float32 masters.
        max_model_len: the engines' context (None: the model's, at most 4096).
        engine_kwargs: more ``vllm.LLM`` arguments (e.g. ``gpu_memory_utilization``).
        overlap: sample step k+1 while step k trains (one step off-policy).
        sync_bucket_mb: weights travel in buckets of about this size, loaded
            while the next ones are still in transit.
        checkpoint_dir: trainer checkpoints, on storage every host sees: a path on
            a filesystem every host mounts, or a URI (``gs://bucket/run``,
            ``s3://...``; pyarrow.fs, as Ray Train's ``storage_path``). None: a
            new temporary directory on the driver, removed by `GRPOLoop.shutdown`
            unless ``keep_checkpoints`` - only on a one-node cluster (refused on
            more nodes, whose hosts would not see it; `rl.storage`).
        checkpoint_every: steps between checkpoints.
        check_parity_every: syncs between bitwise parity checks (0: never).
        reward_workers, reward_timeout_s, on_reward_error: the reward tasks; a
            reward that raises, is NaN/inf or is not a number either stops the
            run with `RewardError` (``"raise"``) or drops that prompt's group
            from the step, logged and counted (``"skip"``).
    """

    model_dir: str
    prompts: Any = None
    reward_fn: Optional[Callable[..., float]] = None
    prompt_key: str = "prompt"
    chat_template: Optional[bool] = None
    num_prompts: int = 8
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    lr: float = 1e-6
    max_grad_norm: float = 1.0
    seed: int = 0
    topology: str = "2x2x1"
    accelerator_type: str = "TPU-V4"
    rollout_topology: Optional[str] = None
    one_slice: bool = False
    num_engines: Optional[int] = None
    tensor_parallel_size: int = 1
    engine_dtype: str = "bfloat16"
    max_model_len: Optional[int] = None
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    overlap: bool = False
    sync_bucket_mb: float = 64.0
    checkpoint_dir: Optional[str] = None
    keep_checkpoints: bool = False
    checkpoint_every: int = 5
    check_parity_every: int = 1
    max_rollout_retries: int = 2
    max_trainer_restarts: int = 2
    reward_workers: int = 4
    reward_timeout_s: float = 600.0
    on_reward_error: str = "raise"

    def __post_init__(self):
        w = "GRPOConfig"
        if not isinstance(self.model_dir, str) or not Path(self.model_dir).is_dir():
            raise V.fail(w, "model_dir", self.model_dir, "a Hugging Face model directory readable on every host",
                         "e.g. model_dir=ray_train_tpu.rl.tiny_addition_model()")
        if self.prompts is None or isinstance(self.prompts, (str, bytes, dict)):
            raise V.fail(w, "prompts", self.prompts, "an iterable of records (dicts), a Ray Dataset or a Hugging "
                         "Face datasets.Dataset", "e.g. prompts=[{'prompt': '1+2=', 'answer': '3'}]", error=TypeError)
        if not callable(self.reward_fn):
            raise V.fail(w, "reward_fn", self.reward_fn, "a function reward_fn(prompt, completion, **fields) -> "
                         "float", "e.g. reward_fn=ray_train_tpu.rl.exact_answer_reward", error=TypeError)
        if not isinstance(self.prompt_key, str) or not self.prompt_key:
            raise V.fail(w, "prompt_key", self.prompt_key, "the name of the record field holding the prompt",
                         "e.g. prompt_key='question'", error=TypeError)
        if self.chat_template is not None:
            V.check_bool(w, "chat_template", self.chat_template, fix="True, False or None (when the tokenizer has one)")
        for name, typ in (("sampling", SamplingConfig), ("algorithm", AlgorithmConfig)):
            if not isinstance(getattr(self, name), typ):
                raise V.fail(w, name, getattr(self, name), f"a {typ.__name__}", f"e.g. {name}={typ.__name__}()",
                             error=TypeError)
        self._check_counts(w)
        V.check_number(w, "lr", self.lr, max=1.0, fix="e.g. lr=1e-6 (3e-3 for the tiny demo model)")
        V.check_number(w, "max_grad_norm", self.max_grad_norm, fix="e.g. max_grad_norm=1.0")
        V.check_choice(w, "engine_dtype", self.engine_dtype, ENGINE_DTYPES)
        V.check_choice(w, "on_reward_error", self.on_reward_error, ON_REWARD_ERROR,
                       fix="'raise' stops the run, 'skip' drops the prompt's group and counts it")
        V.check_bool(w, "one_slice", self.one_slice)
        V.check_bool(w, "overlap", self.overlap)
        V.check_bool(w, "keep_checkpoints", self.keep_checkpoints)
        V.check_number(w, "sync_bucket_mb", self.sync_bucket_mb, max=65536.0, fix="e.g. sync_bucket_mb=64")
        V.check_seconds(w, "reward_timeout_s", self.reward_timeout_s)
        if isinstance(self.checkpoint_dir, Path):
            self.checkpoint_dir = str(self.checkpoint_dir)
        if self.checkpoint_dir is not None and (not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise V.fail(w, "checkpoint_dir", self.checkpoint_dir, "a path every host mounts or a URI (a string), or "
                         "None", "e.g. checkpoint_dir='gs://<bucket>/grpo'", error=TypeError)
        if not isinstance(self.engine_kwargs, dict):
            raise V.fail(w, "engine_kwargs", self.engine_kwargs, "a dict of vllm.LLM arguments", error=TypeError)
        owned = sorted(set(self.engine_kwargs) & _ENGINE_ARGS_OWNED)
        if owned:
            raise ValueError(f"GRPOConfig(engine_kwargs) sets {owned}, which GRPOConfig sets itself; use its fields "
                             "(tensor_parallel_size, engine_dtype, max_model_len, seed) instead (the engines always "
                             "run eager, without prefix caching, with max_num_seqs from num_prompts x n)")

    def _check_counts(self, w: str) -> None:
        for name, low, high in (("num_prompts", 1, 1 << 20), ("checkpoint_every", 1, 1 << 30),
                                ("tensor_parallel_size", 1, 4096),
                                ("max_rollout_retries", 0, 100), ("max_trainer_restarts", 0, 100),
                                ("reward_workers", 1, 1024), ("check_parity_every", 0, 1 << 30)):
            V.check_int(w, name, getattr(self, name), min=low, max=high)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise V.fail(w, "seed", self.seed, "an integer >= 0")
        if self.num_engines is not None:
            V.check_int(w, "num_engines", self.num_engines, min=1, max=4096, fix="e.g. num_engines=2, or None to fill "
                        "the rollout slice")
        if self.max_model_len is not None:
            V.check_int(w, "max_model_len", self.max_model_len, min=2, fix="e.g. max_model_len=1024, or None")

    @property
    def sync_bucket_bytes(self) -> int:
        return max(1, int(math.ceil(self.sync_bucket_mb * 2**20)))


# vllm.LLM arguments GRPOConfig sets from its own fields.
_ENGINE_ARGS_OWNED = frozenset({"model", "tensor_parallel_size", "dtype", "max_model_len", "seed",
                                "distributed_executor_backend", "worker_extension_cls", "weight_transfer_config",
                                "logprobs_mode", "enforce_eager", "max_num_seqs", "enable_prefix_caching"})
