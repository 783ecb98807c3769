"""`GRPOLoop`: GRPO with the trainer on one slice (or half) and vLLM engines on another.

One step, driven from here (the single controller):

1. **rollout** - the engines sample ``n`` completions per prompt (`pool.RolloutPool`;
   an engine that dies mid-generation is replaced and only its share redone);
2. **reward** - ``reward_fn`` on every sample in Ray tasks, then group-relative
   advantages (with ``kl_in="reward"``, after the trainer has scored the KL);
3. **train** - ``ppo_epochs x num_minibatches`` FSDP2 optimizer steps
   (`policy.PolicyWorker`), and every ``checkpoint_every`` steps a checkpoint;
4. **sync** - every trainer rank puts its shards of the new weights, in the
   engines' dtype, in Ray's object store in buckets; every worker of every
   engine loads them through vLLM's weight-transfer API; then the **parity**
   check: each engine's weights equal the trainer's bit for bit, block by block.

At start (no checkpoint to resume) the engines are synced from the trainer and
checked against it, and the trainer against ``model_dir`` (`check_source`): the
run begins from exactly that directory's weights.

With ``overlap=True`` the rollout of step k+1 is submitted as soon as step k's
samples are in, so it runs while step k's rewards, training and publishing
do; the engines load step k's weights once it is done. Step k+1 thus trains on
samples of the weights before step k (one step off-policy), which the ratio to
the recomputed old log-probs and the truncated importance weight account for.

Checkpoints go to storage every host sees (`rl.storage`: a shared mount or a
URI, checked on every trainer and engine host before anything starts). If a
trainer rank dies, the trainer group is replaced, loads the last complete
checkpoint, the engines are re-synced from it (and checked), and the steps
after that checkpoint run again with the same prompts and seeds.

Example:
    >>> with simulated_tpu_cluster("2x2x1", "TPU-V4", num_slices=2):            # doctest: +SKIP
    ...     with GRPOLoop(config) as loop:
    ...         history = loop.run(20)
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ray_train_tpu.rl import step as S
from ray_train_tpu.rl.config import GRPOConfig
from ray_train_tpu.rl.trainer import TrainerGroup, is_actor_failure

logger = logging.getLogger(__name__)
MAX_DEFAULT_MODEL_LEN = 4096


class WeightSyncError(RuntimeError):
    """A rollout engine's weights differ from the trainer's after a sync."""


class GRPOLoop:
    """Reserve the slices, start trainer and engines, and run GRPO steps.

    ``hooks[phase](step)`` is called at ``"rollout_submitted"``, ``"train"`` and
    ``"sync"`` (fault-injection tests use them). ``history`` holds one dict of
    metrics per completed step, in order; a step redone after a trainer restart
    appears again with ``"resumed_from"`` set.
    """

    def __init__(self, config: GRPOConfig):
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"GRPOLoop(config={config!r:.60}) must be a GRPOConfig")
        self.config = config
        self.hooks: dict[str, Callable[[int], None]] = {}
        self.history: list[dict] = []
        self.step = 0
        self.trainer_restarts = 0
        self.slices: list = []
        self.trainer: Optional[TrainerGroup] = None
        self.pool = None
        self._own_ckpt = config.checkpoint_dir is None
        # A path (on a filesystem every host mounts) or a URI (gs://, s3://): see rl.storage.
        self._ckpt_root = config.checkpoint_dir or tempfile.mkdtemp(prefix="ray_train_tpu_grpo_")
        self._resumed_from: Optional[int] = None
        self._pending = None  # overlap: (Prepared, Rollout) of the next step, in flight
        self._failed = False

    # --- set-up and tear-down

    def __enter__(self) -> "GRPOLoop":
        try:
            self.start()
        except BaseException:
            self._failed = True
            self.shutdown()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._failed = self._failed or exc_type is not None
        self.shutdown()

    def start(self) -> None:
        import ray
        from transformers import AutoTokenizer

        from ray_train_tpu.rl import storage
        from ray_train_tpu.rl.data import PromptSource, renderer

        c = self.config
        storage.refuse_driver_local_default(c.checkpoint_dir, sum(1 for n in ray.nodes() if n["Alive"]))
        self.source = PromptSource(c.prompts, seed=c.seed, prompt_key=c.prompt_key)
        self.tokenizer = AutoTokenizer.from_pretrained(c.model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.render = renderer(self.tokenizer, c.chat_template)
        self.max_model_len = c.max_model_len or _model_len(c.model_dir)
        self.reward_ref = ray.put(c.reward_fn)
        trainer_part, rollout_part, layout, plan = self._reserve()
        storage.check_hosts(c.model_dir, self._ckpt_root, [d.node_id for d in trainer_part.devices],
                            [d.node_id for d in rollout_part.devices])
        self.trainer = TrainerGroup(trainer_part, dict(
            model_dir=c.model_dir, lr=c.lr, seed=c.seed, algorithm=c.algorithm, max_grad_norm=c.max_grad_norm,
            temperature=c.sampling.temperature))
        from ray_train_tpu.rl.pool import RolloutPool

        per_engine = -(-c.num_prompts * c.sampling.n // layout.num_engines)
        self.pool = RolloutPool(rollout_part, layout, dict(
            model_dir=c.model_dir, dtype=c.engine_dtype, seed=c.seed, max_model_len=self.max_model_len,
            max_num_seqs=per_engine, engine_kwargs=c.engine_kwargs), max_retries=c.max_rollout_retries,
            slice_plan=plan)
        self.pool.start()
        self.num_params = self.trainer.start()["num_params"]
        self._resume()

    def _reserve(self):
        from ray_train_tpu.device import is_simulated
        from ray_train_tpu.rl import slices
        from ray_train_tpu.rl.rollout import EngineLayout, check_model_fits
        from ray_train_tpu.serve.models import model_shape
        from ray_train_tpu.topology import Topology

        c = self.config
        topology = Topology.parse(c.topology, c.accelerator_type)
        if c.one_slice:
            rollout_topology = slices.half_topology(topology)
        else:
            rollout_topology = Topology.parse(c.rollout_topology or c.topology, c.accelerator_type)
        num_engines = c.num_engines or max(1, rollout_topology.num_devices // c.tensor_parallel_size)
        layout = EngineLayout(topology=rollout_topology, num_engines=num_engines,
                              tensor_parallel_size=c.tensor_parallel_size)
        check_model_fits(model_shape(c.model_dir), c.tensor_parallel_size, c.model_dir)
        if c.one_slice:
            self.slices = list(slices.reserve_halves(topology, simulated=is_simulated()))
        else:
            self.slices = [slices.reserve_slice(topology, name="grpo-trainer")]
            self.slices.append(slices.reserve_slice(rollout_topology, name="grpo-rollout"))
        plan = _whole_slice_plan(self.slices[1]) if layout.num_engines == 1 and self.slices[1].whole_slice else None
        return self.slices[0], self.slices[1], layout, plan

    def shutdown(self) -> None:
        for part in (self.pool, self.trainer):
            if part is not None:
                part.shutdown()
        for s in self.slices:
            s.shutdown()
        self.slices = []
        own = Path(self._ckpt_root) if self._own_ckpt else None
        if own is not None and own.exists():
            if (self._failed or self.config.keep_checkpoints) and any(own.iterdir()):
                logger.warning("GRPO checkpoints kept in %s", self._ckpt_root)
            else:
                shutil.rmtree(own, ignore_errors=True)

    @property
    def checkpoint_root(self):
        """Where the checkpoints go: a `Path`, or the URI (a string) given as ``checkpoint_dir``."""
        return self._ckpt_root if "://" in self._ckpt_root else Path(self._ckpt_root)

    # --- the loop

    def run(self, num_steps: int, on_step: Optional[Callable[[dict], None]] = None) -> list[dict]:
        """Run until step ``num_steps`` is complete; returns `history`."""
        while self.step < num_steps:
            try:
                metrics = self.train_one_step(last=num_steps)
            except Exception as e:
                if not is_actor_failure(e) or self.trainer_restarts >= self.config.max_trainer_restarts:
                    self._failed = True
                    raise
                self._recover_trainer(e)
                continue
            self.history.append(metrics)
            if on_step is not None:
                on_step(metrics)
        return self.history

    def _rollout(self, step: int, in_flight=None) -> tuple:
        """``(prepared, samples, retries)`` of ``step``: the in-flight rollout if any."""
        if in_flight is not None and in_flight[0].step == step:
            prepared, rollout = in_flight
            samples, retries = self.pool.collect(rollout)
            return prepared, samples, retries
        prepared = S.prepare(self, step)
        samples, retries = self.pool.generate(prepared.requests, self.config.sampling,
                                              lambda: self._hook("rollout_submitted", step))
        return prepared, samples, retries

    def train_one_step(self, last: Optional[int] = None) -> dict:
        import ray

        c, step = self.config, self.step + 1
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        prepared, samples, retries = self._rollout(step, pending)
        t1 = time.perf_counter()
        if c.overlap and (last is None or step < last):
            nxt = S.prepare(self, step + 1)
            self._pending = (nxt, self.pool.submit(nxt.requests, c.sampling))  # sampled by the current weights
        kept, values, counts = S.rewards(self, prepared, samples)
        batch, num_rows = S.build(self, prepared, samples, kept, values)
        if c.algorithm.kl_coef and c.algorithm.kl_in == "reward":
            kl = S.gather_rows(self.trainer.call("score", ray.put(batch), step), batch.num_rows)
            adjusted = S.kl_adjusted(values, kl, c.algorithm.kl_coef, c.sampling.n)
            batch, num_rows = S.build(self, prepared, samples, kept, adjusted)
            counts["kl_reward"] = sum(kl[:num_rows]) / max(num_rows, 1)  # mean summed KL per completion
        t2 = time.perf_counter()
        self._hook("train", step)
        train = self.trainer.call("train", ray.put(batch), step)[0]
        t3 = time.perf_counter()
        if step % c.checkpoint_every == 0:
            self.trainer.call("save", self._ckpt_root, f"step_{step:06d}", step)
        t4 = time.perf_counter()
        self._hook("sync", step)
        sync = self._sync(check=bool(c.check_parity_every) and step % c.check_parity_every == 0)
        self.step = step
        metrics = {"step": step, **S.metrics(values, num_rows, batch), **train, "rollout_s": t1 - t0,
                   "reward_s": t2 - t1, "train_s": t3 - t2, "checkpoint_s": t4 - t3, **sync,
                   "rollout_retries": retries, "resumed_from": self._resumed_from,
                   "prompts_skipped_too_long": prepared.skipped_too_long, **counts,
                   "prompt": str(prepared.records[0][c.prompt_key]), "sample": S.sample_text(samples),
                   "off_policy": pending is not None}
        metrics["step_s"] = time.perf_counter() - t0
        self._resumed_from = None
        return metrics

    # --- weights

    def _publish(self) -> tuple[list, dict]:
        parts = self.trainer.call("publish_weights", self.config.engine_dtype, self.config.sync_bucket_bytes)
        buckets = [list(refs) for refs in zip(*(p["refs"] for p in parts))]  # per bucket, ranks in order
        self._layout = {name: [p["rows"][name] for p in parts] for name in parts[0]["rows"]}
        return buckets, self._layout

    def _sync(self, check: bool = True) -> dict:
        """Trainer -> object store -> every engine; then the parity check. With a
        rollout in flight (overlap), the engines load once it is done."""
        t0 = time.perf_counter()
        buckets, _ = self._publish()
        t1 = time.perf_counter()
        wait_s = 0.0
        if self._pending is not None:
            self.pool.prefetch(buckets)
            self.pool.collect(self._pending[1])  # the engines finish it before they load; kept for the next step
            wait_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        load_s = self.pool.sync(buckets)
        t3 = time.perf_counter()
        if check:
            self.check_parity()
        return {"publish_s": t1 - t0, "rollout_wait_s": wait_s, "engine_load_s": load_s,
                "sync_s": (t1 - t0) + (t3 - t2), "parity_s": time.perf_counter() - t3, "parity_checked": check}

    def check_parity(self) -> int:
        """Raise `WeightSyncError` unless every engine holds the trainer's weights
        (in the engine's dtype) bit for bit; returns the number of blocks compared."""
        from ray_train_tpu.rl.weights import mismatches

        engines = self.pool.digests()
        self.last_engine_digests = engines[0]
        expected = {k: v for part in self.trainer.call("shard_digests", self._layout, self.pool.tp_specs())
                    for k, v in part.items()}
        for i, got in enumerate(engines):
            bad = mismatches(expected, got)
            if bad:
                raise WeightSyncError(f"rollout engine {i} differs from the trainer in {len(bad)} of "
                                      f"{len(expected)} blocks after a sync: {'; '.join(bad[:3])}")
        return len(expected)

    def check_source(self) -> int:
        """Raise `WeightSyncError` unless the trainer holds exactly ``model_dir``'s
        weights, bit for bit (each rank its shard, read from the directory's
        safetensors; in the trainer's dtype); returns the number of tensors
        compared. Run at start, with no checkpoint to resume: with the first
        parity check (engines = trainer), a run begins from the directory's
        weights, e.g. an export (`ray_train_tpu.checkpoint.export_hf`)."""
        bad = [line for part in self.trainer.call("source_mismatches", self._layout) for line in part]
        if bad:
            raise WeightSyncError(f"the trainer's weights at step 0 differ from model_dir {self.config.model_dir!r} "
                                  f"in {len(bad)} of {len(self._layout)} tensors: {'; '.join(bad[:3])}")
        return len(self._layout)

    # --- failures

    def _resume(self) -> None:
        """Load the newest complete checkpoint into the trainer (if any), then sync the engines."""
        from ray_train_tpu.rl import storage

        self._pending = None  # samples of weights that may be newer than the checkpoint
        latest = storage.latest(self._ckpt_root)
        if latest is not None:
            self.step = self.trainer.call("load", latest)[0]
            self._resumed_from = self.step
            logger.warning("GRPO trainer resumed from %s (step %d)", latest, self.step)
        else:
            self.step = 0
        self.initial_sync = self._sync(check=True)
        self.resync_digests = self.last_engine_digests  # what the engine held before the next rollout
        if latest is None and self.config.check_parity_every:
            t0 = time.perf_counter()  # the engines equal the trainer; the trainer must equal model_dir
            self.initial_sync.update(source_tensors=self.check_source(), source_s=time.perf_counter() - t0)

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


def _model_len(model_dir: str) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(config.get("max_position_embeddings") or MAX_DEFAULT_MODEL_LEN), MAX_DEFAULT_MODEL_LEN)


def _whole_slice_plan(reservation) -> Optional[str]:
    """Serving's slice plan for an engine that is a whole slice (its workers then
    run serving's env/place check); None when the slice has no labels."""
    import time as _time

    from ray_train_tpu.serve.slice_plan import BundlePlace, plan_slice

    places = [BundlePlace(index=d.bundle, node_id=d.node_id, node_ip=d.node_ip, slice_name=d.slice_name,
                          worker_id=d.worker_id, chip=d.chip) for d in reservation.devices]
    if any(p.worker_id is None or p.chip is None for p in places):
        return None
    return plan_slice(reservation.topology, places, xprof_session_id=str(_time.time_ns())).to_json()
