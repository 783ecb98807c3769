"""The rollout engines: vLLM on the rollout slice, ``num_engines`` of
``tensor_parallel_size`` devices each, filling it.

Each `RolloutEngine` is a Ray actor running ``vllm.LLM``. With one device it
holds that chip and runs vLLM's single-worker executor in its own process;
with more, it sits in its first device's bundle and vLLM's Ray executor puts
one worker in each of its devices' bundles (``VLLM_RAY_BUNDLE_INDICES``), on as
many hosts as the devices span. Devices are dealt out in (TPU worker id, chip)
order, so engine ``e`` has devices ``e*tp .. (e+1)*tp - 1``. vLLM's platform
comes from our plugin (`ray_train_tpu.serve.platforms`): the simulated TPU
platform in explicit simulation, vllm-torchtpu on TPUs, never a CPU fallback.
After start, each engine checks that vLLM rank ``r`` runs on the host and chip
its layout gives it; an engine that is a whole slice also gets serving's slice
plan, and so its env/place check in every worker.

Weights arrive through vLLM's ``worker_extension_cls``
(`ray_train_tpu.rl._vllm_worker`), a path that exists on vllm-torchtpu's
``TPUWorker`` as on the CPU worker (vLLM's weight-transfer API does not).
Requests carry no seed (vllm-torchtpu refuses per-request seeds): each engine
has its own seed (`engine_seed`), and one engine's sampling is reproducible
given its requests in order. Log-probs are of the raw logits (vllm-torchtpu's
``gather_logprobs``, before temperature); the trainer turns them into the
sampler's (`ray_train_tpu.rl.temperature`). `RolloutPool` deals a step's
prompts out to the engines and, when an engine dies mid-generation, starts a
new one on the same devices with a new seed, loads the latest weights and
re-draws only that engine's share (logged, and counted in ``rollout_retries``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional, Sequence

from ray_train_tpu import _environ
from ray_train_tpu.device import is_simulated
from ray_train_tpu.rl.config import SamplingConfig
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)


def engine_env(tensor_parallel_size: int, simulated: bool) -> dict:
    """A rollout engine's environment (its Ray workers get the VLLM_* ones too):
    serving's `ray_train_tpu.serve.engine.engine_env` (the executor's
    ``TPU_MULTIHOST_BACKEND`` when the engine's workers are Ray actors, TP > 1),
    the engine core in the actor's own process, the model from its directory."""
    from ray_train_tpu.serve.engine import IN_PROCESS_ENV
    from ray_train_tpu.serve.engine import engine_env as serve_engine_env

    return {**serve_engine_env(simulated=simulated, ray_executor=tensor_parallel_size > 1, offline=True),
            **IN_PROCESS_ENV}


def engine_seed(seed: int, engine: int, incarnation: int = 0) -> int:
    """Engine ``engine``'s sampling seed: distinct per engine, and per restart
    (``incarnation``), so that a re-drawn share draws anew, never a replay."""
    return (seed * 1_000_003 + engine * 7_919 + incarnation * 104_729) % 2**31
# KV cache of each simulated worker (CPU memory; vLLM's CPU default is 4 GiB); on TPUs vLLM sizes it.
SIMULATED_KV_CACHE_BYTES = 128 * 2**20
# Fault injection on simulated hosts only: seconds every generate call waits first,
# so that a test can kill an engine while its call is surely in flight.
SIMULATE_ROLLOUT_DELAY_ENV = "RAY_TRAIN_TPU_SIMULATE_ROLLOUT_DELAY_S"
EXTENSION = "ray_train_tpu.rl._vllm_worker.WeightSyncExtension"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLayout:
    """``num_engines`` engines of ``tensor_parallel_size`` devices on ``topology``."""

    topology: Topology
    num_engines: int
    tensor_parallel_size: int

    def __post_init__(self):
        n, tp, dph = self.num_engines, self.tensor_parallel_size, self.topology.devices_per_host
        devices = self.topology.num_devices
        if n * tp != devices:
            fits = ", ".join(f"{devices // t} x {t}" for t in range(1, devices + 1) if devices % t == 0)
            raise ValueError(f"GRPOConfig(num_engines={n}, tensor_parallel_size={tp}): {n} x {tp} = {n * tp} does "
                             f"not fill the rollout slice's {devices} devices ({self.topology}); engines x devices "
                             f"per engine must be {devices}: {fits}")
        if not (dph % tp == 0 or tp % dph == 0):
            raise ValueError(f"GRPOConfig(tensor_parallel_size={tp}): an engine must take part of one host or whole "
                             f"hosts ({dph} devices per host of {self.topology}); use a divisor or multiple of {dph}")

    def devices(self, engine: int) -> range:
        tp = self.tensor_parallel_size
        return range(engine * tp, (engine + 1) * tp)


def check_model_fits(shape, tensor_parallel_size: int, model_dir: str) -> None:
    """vLLM's rules for TP (attention and KV heads), via serving's `ModelShape`."""
    why = shape.tp_problem(tensor_parallel_size)
    if why:
        raise ValueError(f"GRPOConfig(tensor_parallel_size={tensor_parallel_size}) cannot shard {model_dir}: {why}; "
                         "choose a tensor_parallel_size that divides the attention heads")


class RolloutEngine:
    """vLLM on ``tensor_parallel_size`` devices (a Ray actor)."""

    def __init__(self, model_dir: str, *, dtype: str, seed: int, max_model_len: int, max_num_seqs: int,
                 tensor_parallel_size: int = 1, bundle_indices: Sequence[int] = (),
                 expected_places: Sequence[tuple] = (), slice_plan: Optional[str] = None,
                 engine_kwargs: Optional[dict] = None, slice_name: Optional[str] = None):
        import ray

        from ray_train_tpu.serve import platforms

        if tensor_parallel_size == 1 and slice_name:
            # A one-chip engine holds its chip itself: the right slice, host and one
            # chip, and its host's multi-host job variables gone before vLLM starts
            # (serving's check: a lone chip of a multi-host slice is its own device).
            from ray_train_tpu.serve.worker_check import check_chip_engine

            check_chip_engine(slice_name=slice_name, host=expected_places[0][0] if expected_places else None)

        engine_kwargs = dict(engine_kwargs or {})
        env = {**engine_env(tensor_parallel_size, is_simulated()), platforms.VLLM_HOST_IP: ray.util.get_node_ip_address()}
        if is_simulated():
            engine_kwargs.setdefault("kv_cache_memory_bytes", SIMULATED_KV_CACHE_BYTES)
        if tensor_parallel_size > 1:
            env[platforms.VLLM_RAY_BUNDLE_INDICES] = ",".join(map(str, bundle_indices))
        if slice_plan:
            env[platforms.SLICE_PLAN_ENV] = slice_plan
        _environ.update(env)  # before vLLM is imported: it reads them once
        from vllm import LLM
        from vllm.platforms import current_platform

        if not is_simulated() and current_platform.device_type != "tpu":
            raise RuntimeError(
                f"this rollout engine holds a TPU but vLLM chose its {current_platform.device_type!r} platform: "
                "install vllm-torchtpu on every TPU host, or set RAY_TRAIN_TPU_SIMULATE=1 to simulate on CPU")
        # vllm-torchtpu picks the executor from TPU_MULTIHOST_BACKEND (set by engine_env);
        # distributed_executor_backend says the same to vLLM's other platforms.
        self.seed = seed
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enforce_eager=True, enable_prefix_caching=False,
                       tensor_parallel_size=tensor_parallel_size,
                       distributed_executor_backend="ray" if tensor_parallel_size > 1 else None,
                       worker_extension_cls=EXTENSION, **engine_kwargs)
        self.places = self.llm.collective_rpc("rl_place")
        _check_places(self.places, expected_places)

    def generate(self, requests: Sequence[Sequence[int]], sampling: SamplingConfig) -> list:
        """``requests``: prompt token ids each (no seed: the engine's own, see
        `engine_seed`); returns, per request, ``sampling.n`` dicts with
        ``token_ids``, ``text`` and ``logprobs`` (of the sampled tokens under the
        raw logits, before temperature, as vllm-torchtpu reports them)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        delay = _environ.get(SIMULATE_ROLLOUT_DELAY_ENV)
        if delay and is_simulated():
            time.sleep(float(delay))
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in requests]
        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                                logprobs=0)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids), "text": c.text,
                  "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]}
                 for c in out.outputs] for out in outputs]

    def load_weights(self, mailbox: str, version: int) -> float:
        """Every worker loads weights ``version`` from the `weights.WeightMailbox`
        actor named ``mailbox``; returns the seconds it took."""
        start = time.perf_counter()
        self.llm.collective_rpc("rl_load_weights", args=({"mailbox": mailbox, "version": version},))
        return time.perf_counter() - start

    def worker_places(self) -> list[dict]:
        """Each vLLM worker's rank, TP rank, host and chips (as checked at start)."""
        return list(self.places)

    def tp_specs(self) -> list[dict]:
        """Per TP rank, ``{hf name: its slice}`` (see `ray_train_tpu.rl.weights`)."""
        return self.llm.collective_rpc("rl_tp_specs")

    def weight_digests(self) -> dict:
        """``{block key: digest}`` of the weights every worker computes with."""
        out = {}
        for part in self.llm.collective_rpc("rl_weight_digests"):
            out.update(part)
        return out

    def pid(self) -> int:
        import os

        return os.getpid()


def _check_places(places: Sequence[dict], expected: Sequence[tuple]) -> None:
    """vLLM rank ``r`` must run on host ``expected[r][0]``, chip ``expected[r][1]``
    (vLLM re-ranks its Ray workers by host after placing them)."""
    if not expected:
        return
    got = {p["rank"]: (p["node_ip"], p["chips"]) for p in places}
    bad = [f"rank {r}: {got.get(r)} instead of ({ip!r}, [{chip}])" for r, (ip, chip) in enumerate(expected)
           if got.get(r) != (ip, [chip])]
    if bad:
        raise RuntimeError("rollout engine's vLLM workers are not where its layout puts them (rank order follows "
                           f"TPU worker id, then chip): {'; '.join(bad)}")
