"""`GRPOLoop`: GRPO with the trainer on slice A and vLLM rollouts on slice B.

One step, driven from here (the single controller):

1. **rollout** – slice B's engines sample ``n`` completions per prompt
   (`rollout.RolloutPool`; an engine that dies mid-generation is replaced and
   only its share of the step is redone);
2. **reward** – the user's ``reward_fn(prompt, completion)`` on every sample,
   then group-relative advantages (`grpo.group_advantages`);
3. **train** – one FSDP2 optimizer step over slice A (`policy.PolicyWorker`),
   and every ``checkpoint_every`` steps a checkpoint (`ray_train_tpu.checkpoint`);
4. **sync** – every trainer rank's shard of the weights (or rank 0's gathered
   state dict), in the engine's dtype, goes through Ray's object store into
   every engine with vLLM's own loader; then the **parity** check: every
   engine's weights must equal the trainer's bit for bit, shard by shard.

The two slices never share a process group: the trainer's spans slice A only
(``setup_process_group``), each engine is a single vLLM worker.
If a trainer rank dies, the whole trainer group is replaced, it loads the last
complete checkpoint, the engines are re-synced from it (and checked), and the
steps after that checkpoint run again with the same prompts and seeds.

Example:
    >>> with simulated_tpu_cluster("2x2x1", "TPU-V4", num_slices=2):            # doctest: +SKIP
    ...     with GRPOLoop(GRPOConfig(model_dir=tiny_addition_model())) as loop:
    ...         history = loop.run(20)
    >>> history[-1]["reward_mean"] > history[0]["reward_mean"]                  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ray_train_tpu.rl.rollout import RolloutPool, SamplingConfig
from ray_train_tpu.rl.tasks import Task, addition_task

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from the trainer's after a sync."""


@dataclasses.dataclass(kw_only=True)
class GRPOConfig:
    """Everything a GRPO run needs.

    Args:
        model_dir: a Hugging Face model directory, readable on every host.
        task: prompts and reward (default: `tasks.addition_task`).
        num_prompts: prompts per step; ``sampling.n`` completions each.
        lr, clip_eps, max_grad_norm: the optimizer step (AdamW) and the loss.
        topology, accelerator_type: one slice; the run reserves two of them,
            the trainer's and the rollout engines'.
        num_engines: vLLM engines on the rollout slice, one chip each.
        engine_dtype: the engine's weights (``"bfloat16"`` or ``"float32"``);
            the trainer keeps float32 master weights and casts when it syncs.
        weight_sync: ``"shards"`` (every trainer rank puts its own FSDP2 shard in
            the object store; no gather) or ``"full"`` (rank 0 gathers the full
            state dict and puts it).
        checkpoint_dir: where trainer checkpoints go (default: a new temporary
            directory); must be shared by the trainer's hosts.
        checkpoint_every: steps between checkpoints.
        check_parity_every: syncs between bitwise parity checks (1: every sync).
        max_trainer_restarts: trainer failures survived before giving up.
    """

    model_dir: str
    task: Task = dataclasses.field(default_factory=addition_task)
    num_prompts: int = 8
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    lr: float = 3e-3
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    seed: int = 0
    topology: str = "2x2x1"
    accelerator_type: str = "TPU-V4"
    num_engines: int = 1
    engine_dtype: str = "bfloat16"
    weight_sync: str = "shards"
    max_model_len: int = 64
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 5
    check_parity_every: int = 1
    max_rollout_retries: int = 2
    max_trainer_restarts: int = 2

    def __post_init__(self):
        for name in ("num_prompts", "checkpoint_every", "check_parity_every", "num_engines"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GRPOConfig({name}={value!r}) must be an integer >= 1")
        if not self.lr > 0:
            raise ValueError(f"GRPOConfig(lr={self.lr!r}) must be > 0")
        if self.weight_sync not in ("shards", "full"):
            raise ValueError(f"GRPOConfig(weight_sync={self.weight_sync!r}) must be 'shards' or 'full'")
        if self.engine_dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"GRPOConfig(engine_dtype={self.engine_dtype!r}) must be 'bfloat16', 'float16' "
                             "or 'float32'")
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"GRPOConfig(model_dir={self.model_dir!r}) is not a directory; give a Hugging Face "
                             "model directory (see ray_train_tpu.rl.models)")


class TrainerGroup:
    """The `PolicyWorker` actors on every chip of slice A, in rank order."""

    def __init__(self, reservation, worker_kwargs: dict):
        self.reservation, self.worker_kwargs = reservation, worker_kwargs
        self.actors: list = []

    def start(self) -> dict:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ray_train_tpu.actors import setup_process_group
        from ray_train_tpu.rl.policy import PolicyWorker

        cls = ray.remote(PolicyWorker)
        pg = self.reservation.placement_group
        actors = [cls.options(num_cpus=1, resources={"TPU": 1}, max_restarts=0, scheduling_strategy=
                              PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                  .remote(**self.worker_kwargs) for i in range(len(self.reservation.node_ips))]
        self.actors = setup_process_group(actors)
        return self.call("build")[0]

    def call(self, method: str, *args) -> list:
        """``method`` on every rank; raises the first failure without waiting for
        ranks that may hang in a collective with a dead peer."""
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except Exception as first:
                # A dead rank makes its peers' collectives fail too: report the death, the cause.
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
                for ref in done:
                    try:
                        ray.get(ref)
                    except Exception as e:
                        if _is_actor_failure(e):
                            raise e from None
                raise first
        return ray.get(refs)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []


def _is_actor_failure(e: BaseException) -> bool:
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError))


class GRPOLoop:
    """Reserve the two slices, start trainer and engines, and run GRPO steps.

    ``hooks[phase](step)`` is called at ``"rollout_submitted"``, ``"train"`` and
    ``"sync"`` (fault-injection tests use them). ``history`` holds one dict of
    metrics per completed step, in order; a step redone after a trainer restart
    appears again with ``"resumed_from"`` set.
    """

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.hooks: dict[str, Callable[[int], None]] = {}
        self.history: list[dict] = []
        self.step = 0
        self.trainer_restarts = 0
        self.slices: list = []
        self.trainer: Optional[TrainerGroup] = None
        self.pool: Optional[RolloutPool] = None
        self._ckpt_root = Path(config.checkpoint_dir or tempfile.mkdtemp(prefix="ray_train_tpu_grpo_"))
        self._resumed_from: Optional[int] = None

    # --- set-up and tear-down

    def __enter__(self) -> "GRPOLoop":
        try:
            self.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> None:
        from transformers import AutoTokenizer

        from ray_train_tpu.rl.slices import reserve_slice
        from ray_train_tpu.topology import Topology

        c = self.config
        topology = Topology.parse(c.topology, c.accelerator_type)
        self.tokenizer = AutoTokenizer.from_pretrained(c.model_dir)
        self.slices = [reserve_slice(topology, name="grpo-trainer"), reserve_slice(topology, name="grpo-rollout")]
        self.trainer = TrainerGroup(self.slices[0], dict(model_dir=c.model_dir, lr=c.lr, seed=c.seed,
                                                         max_grad_norm=c.max_grad_norm, clip_eps=c.clip_eps))
        width = max(c.max_model_len, 16)
        self.pool = RolloutPool(self.slices[1], dict(model_dir=c.model_dir, dtype=c.engine_dtype, seed=c.seed,
                                                     max_model_len=width,
                                                     max_num_seqs=c.num_prompts * c.sampling.n),
                                num_engines=c.num_engines, max_retries=c.max_rollout_retries)
        self.pool.start()
        self.num_params = self.trainer.start()["num_params"]
        self._resume()

    def shutdown(self) -> None:
        for part in (self.pool, self.trainer):
            if part is not None:
                part.shutdown()
        for s in self.slices:
            s.shutdown()
        self.slices = []

    # --- the loop

    def run(self, num_steps: int, on_step: Optional[Callable[[dict], None]] = None) -> list[dict]:
        """Run until step ``num_steps`` is complete; returns `history`."""
        while self.step < num_steps:
            try:
                metrics = self.train_one_step()
            except Exception as e:
                if not _is_actor_failure(e) or self.trainer_restarts >= self.config.max_trainer_restarts:
                    raise
                self._recover_trainer(e)
                continue
            self.history.append(metrics)
            if on_step is not None:
                on_step(metrics)
        return self.history

    def train_one_step(self) -> dict:
        import ray
        import torch

        from ray_train_tpu.rl.grpo import build_batch, group_advantages

        c, step = self.config, self.step + 1
        t0 = time.perf_counter()
        prompts = c.task.prompts(step, c.num_prompts, c.seed)
        ids = [self.tokenizer(p.text, add_special_tokens=False).input_ids for p in prompts]
        # vLLM seeds the n samples of a request with seed, seed + 1, ...: space the prompts
        # n apart, or neighbouring prompts would share their random draws.
        base = (c.seed * 1_000_003 + step) * 1_000_003
        requests = [(x, (base + i * c.sampling.n) % 2**63) for i, x in enumerate(ids)]
        samples, retries = self.pool.generate(requests, c.sampling, lambda: self._hook("rollout_submitted", step))
        t1 = time.perf_counter()
        rewards = [[float(c.task.reward_fn(p, s["text"])) for s in group] for p, group in zip(prompts, samples)]
        adv = group_advantages(torch.tensor(rewards))
        flat = [(ids[i], s, adv[i, j].item()) for i, group in enumerate(samples) for j, s in enumerate(group)]
        batch = build_batch([f[0] for f in flat], [f[1]["token_ids"] for f in flat], [f[2] for f in flat],
                            self.tokenizer.pad_token_id, [f[1]["logprobs"] for f in flat])
        t2 = time.perf_counter()
        self._hook("train", step)
        train = self.trainer.call("train_step", ray.put(batch), batch.num_completion_tokens)[0]
        t3 = time.perf_counter()
        if step % c.checkpoint_every == 0:
            self.trainer.call("save", str(self._ckpt_root / f"step_{step:06d}"), step)
        t4 = time.perf_counter()
        self._hook("sync", step)
        sync = self._sync(check=step % c.check_parity_every == 0)
        self.step = step
        all_r = [r for group in rewards for r in group]
        metrics = {
            "step": step, "reward_mean": statistics.fmean(all_r), "reward_std": statistics.pstdev(all_r),
            "reward_min": min(all_r), "reward_max": max(all_r),
            "exact": sum(r == 1.0 for r in all_r) / len(all_r),
            "completion_tokens": batch.num_completion_tokens / len(all_r),
            **train, "rollout_s": t1 - t0, "reward_s": t2 - t1, "train_s": t3 - t2, "checkpoint_s": t4 - t3,
            **sync, "rollout_retries": retries, "resumed_from": self._resumed_from,
            "sample": samples[0][0]["text"], "prompt": prompts[0].text,
        }
        metrics["step_s"] = time.perf_counter() - t0
        self._resumed_from = None
        return metrics

    # --- weights

    def _sync(self, check: bool = True) -> dict:
        """Trainer -> object store -> every engine; then the parity check."""
        t0 = time.perf_counter()
        wrapped = [ref for r in self.trainer.call("publish_weights", self.config.engine_dtype,
                                                  self.config.weight_sync) if r for ref in r]
        t1 = time.perf_counter()
        load_s = self.pool.sync(wrapped)
        t2 = time.perf_counter()
        if check:
            self.check_parity()
        return {"publish_s": t1 - t0, "engine_load_s": load_s, "sync_s": t2 - t0,
                "parity_s": time.perf_counter() - t2, "parity_checked": check}

    def check_parity(self) -> int:
        """Raise `WeightSyncError` unless every engine holds the trainer's weights
        (in the engine's dtype) bit for bit; returns the number of tensors compared."""
        from ray_train_tpu.rl.weights import mismatches

        engines = self.pool.digests()
        self.last_engine_digests = engines[0]
        expected = {k: v for part in self.trainer.call("shard_digests") for k, v in part.items()}
        for i, got in enumerate(engines):
            bad = mismatches(expected, got)
            if bad:
                raise WeightSyncError(f"rollout engine {i} differs from the trainer in {len(bad)} of "
                                      f"{len(expected)} tensors after a sync: {'; '.join(bad[:3])}")
        return len(expected)

    # --- failures

    def _resume(self) -> None:
        """Load the newest complete checkpoint into the trainer (if any), then sync the engines."""
        from ray_train_tpu import checkpoint

        latest = checkpoint.latest_checkpoint(self._ckpt_root)
        if latest is not None:
            self.step = self.trainer.call("load", str(latest))[0]
            self._resumed_from = self.step
            logger.warning("GRPO trainer resumed from %s (step %d)", latest, self.step)
        else:
            self.step = 0
        self.initial_sync = self._sync(check=True)
        self.resync_digests = self.last_engine_digests  # what the engine held before the next rollout

    def _recover_trainer(self, error: BaseException) -> None:
        logger.warning("GRPO trainer failed at step %d (%s); restarting it from its last checkpoint",
                       self.step + 1, error)
        self.trainer_restarts += 1
        self.trainer.shutdown()
        self.trainer.start()
        self._resume()

    def _hook(self, phase: str, step: int) -> None:
        if phase in self.hooks:
            self.hooks[phase](step)
