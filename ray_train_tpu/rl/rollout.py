"""The rollout engines: vLLM on slice B, one engine per chip used, data parallel.

Each `RolloutEngine` is a Ray actor holding ``{"TPU": 1}`` in a bundle of slice
B's placement group and running ``vllm.LLM`` in its own process (vLLM's
in-process engine and single-worker executor: one chip, no process group
shared with anything). In explicit simulation vLLM runs its CPU platform
(``VLLM_TARGET_DEVICE=cpu``); on a TPU host it must find a TPU platform
(vllm-torchtpu) or the engine refuses to start: never a CPU fallback.
Several samples per prompt are vLLM's ``n``; every prompt has its own sampling
seed, so a retried request draws the same samples.

`RolloutPool` splits a step's prompts over the engines and, when an engine dies
mid-generation, starts a new one in the same bundle, loads the latest weights
into it and re-runs only that engine's share: the step costs more time and
nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional, Sequence

from ray_train_tpu import constants as C
from ray_train_tpu import _environ
from ray_train_tpu.device import is_simulated

logger = logging.getLogger(__name__)

# vLLM settings of a rollout engine's process (simulation: vLLM's CPU backend).
# TODO(serve): these names move to ray_train_tpu.constants with the serving platform plugin.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine lives (and dies) with the actor's process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # simulated chips share the machine's cores
    "HF_HUB_OFFLINE": "1",
}
SIMULATION_ENGINE_ENV = {C.VLLM_TARGET_DEVICE: "cpu"}
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on the CPU backend
# Fault injection on simulated hosts only: seconds every generate call waits first,
# so that a test can kill an engine while its call is surely in flight.
SIMULATE_ROLLOUT_DELAY_ENV = "RAY_TRAIN_TPU_SIMULATE_ROLLOUT_DELAY_S"
EXTENSION = "ray_train_tpu.rl._vllm_worker.WeightSyncExtension"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How completions are drawn: ``n`` per prompt, ``temperature``, ``max_tokens``."""

    n: int = 8
    temperature: float = 1.0
    max_tokens: int = 4

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 2:
            raise ValueError(f"SamplingConfig(n={self.n!r}) must be an integer >= 2: GRPO compares samples of a prompt")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig(temperature={self.temperature!r}) must be > 0 (sampling, not greedy)")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingConfig(max_tokens={self.max_tokens!r}) must be an integer >= 1")


class RolloutEngine:
    """vLLM on one chip (a Ray actor)."""

    def __init__(self, model_dir: str, *, dtype: str, seed: int, max_model_len: int, max_num_seqs: int,
                 kv_cache_gib: int = 1):
        import ray

        env = {**ENGINE_ENV, KV_CACHE_ENV: str(kv_cache_gib), "VLLM_HOST_IP": ray.util.get_node_ip_address()}
        if is_simulated():
            env.update(SIMULATION_ENGINE_ENV)
        _environ.update(env)  # before vLLM is imported: it reads them once
        from vllm import LLM
        from vllm.platforms import current_platform

        if not is_simulated() and current_platform.device_type != "tpu":
            raise RuntimeError(
                f"this rollout engine holds a TPU but vLLM chose its {current_platform.device_type!r} platform: "
                "install vllm-torchtpu on every TPU host, or set RAY_TRAIN_TPU_SIMULATE=1 to simulate on CPU")
        self._layout = None  # rows per trainer shard of each tensor last loaded
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enforce_eager=True, enable_prefix_caching=False,
                       worker_extension_cls=EXTENSION)

    def generate(self, requests: Sequence[tuple], sampling: SamplingConfig) -> list:
        """``requests``: ``(prompt_token_ids, seed)`` each; returns, per request,
        ``sampling.n`` dicts with ``token_ids``, ``text`` and ``logprobs`` (of the
        sampled tokens)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        delay = _environ.get(SIMULATE_ROLLOUT_DELAY_ENV)
        if delay and is_simulated():
            time.sleep(float(delay))
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids, _ in requests]
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
                                 logprobs=0, seed=seed) for _, seed in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[{"token_ids": list(c.token_ids), "text": c.text,
                  "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]}
                 for c in out.outputs] for out in outputs]

    def load_weights(self, wrapped: list) -> float:
        """Load the weights behind ``wrapped`` (ObjectRefs of Hugging Face-named
        state dicts, the trainer's shards in rank order: concatenated along dim 0)
        with vLLM's own loader; returns the seconds it took after the transfer."""
        import ray
        import torch

        shards = ray.get(list(wrapped))
        start = time.perf_counter()
        self._layout = {n: [s[n].shape[0] for s in shards] for n in shards[0]}
        full = {n: torch.cat([s[n] for s in shards]) if len(shards) > 1 else shards[0][n] for n in shards[0]}
        self.llm.collective_rpc("rl_load_weights", args=(full,))
        return time.perf_counter() - start

    def weight_digests(self) -> dict:
        """``{"<hf name>#<shard>": digest}`` of the weights the engine computes with,
        cut as the last weights loaded were (see `ray_train_tpu.rl.weights`)."""
        if self._layout is None:
            raise RuntimeError("weight_digests before load_weights: nothing to compare with yet")
        return self.llm.collective_rpc("rl_weight_digests", args=(self._layout,))[0]

    def pid(self) -> int:
        import os

        return os.getpid()


class RolloutPool:
    """Engines on bundles of a `SliceReservation`, with retry of a failed engine's share."""

    def __init__(self, reservation, engine_kwargs: dict, *, num_engines: int, max_retries: int = 2):
        n_bundles = len(reservation.node_ips)
        if not isinstance(num_engines, int) or not 1 <= num_engines <= n_bundles:
            raise ValueError(f"num_engines={num_engines!r} must be an integer in 1..{n_bundles} "
                             f"(one engine per chip of the rollout slice {reservation.topology})")
        self.reservation, self.engine_kwargs = reservation, dict(engine_kwargs)
        self.num_engines, self.max_retries = num_engines, max_retries
        self.engines: list = []
        self.restarts = 0
        self._weights: Optional[list] = None  # ObjectRefs of the last weights synced

    def start(self) -> None:
        import ray

        self.engines = [self._new_engine(i) for i in range(self.num_engines)]
        ray.get([e.pid.remote() for e in self.engines])

    def _new_engine(self, bundle: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.reservation.placement_group,
                                                    placement_group_bundle_index=bundle)
        cls = ray.remote(RolloutEngine)
        return cls.options(num_cpus=1, resources={"TPU": 1}, scheduling_strategy=strategy,
                           max_restarts=0).remote(**self.engine_kwargs)

    def _restart(self, index: int) -> None:
        import ray

        logger.warning("rollout engine %d died; starting a new one on the same chip", index)
        ray.kill(self.engines[index])
        self.engines[index] = self._new_engine(index)
        self.restarts += 1
        if self._weights is not None:  # the newest weights, not the ones on disk
            ray.get(self.engines[index].load_weights.remote(self._weights))

    def generate(self, requests: list, sampling: SamplingConfig, on_submitted=None) -> tuple[list, int]:
        """Completions of every request (in order) and how many shares were retried.
        ``on_submitted()`` runs once every engine has its share (a hook for fault tests)."""
        import ray

        shares = [requests[i::self.num_engines] for i in range(self.num_engines)]
        pending = {i: self.engines[i].generate.remote(s, sampling) for i, s in enumerate(shares) if s}
        if on_submitted is not None:
            on_submitted()
        results, retries = {}, 0
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                results[i] = ray.get(ref)
                del pending[i]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                retries += 1
                if retries > self.max_retries:
                    raise RuntimeError(f"rollout failed {retries} times in one step; last: {e}") from e
                self._restart(i)
                pending[i] = self.engines[i].generate.remote(shares[i], sampling)
        out = [None] * len(requests)
        for i, share in results.items():
            for j, completions in enumerate(share):
                out[i + j * self.num_engines] = completions
        return out, retries

    def sync(self, wrapped: list) -> float:
        """Every engine loads the weights behind ``wrapped``; returns the slowest load's seconds."""
        import ray

        self._weights = wrapped
        refs = [e.load_weights.remote(wrapped) for e in self.engines]
        seconds = []
        for i, ref in enumerate(refs):
            try:
                seconds.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                self._restart(i)  # loads `wrapped` into the new engine
        return max(seconds, default=0.0)

    def digests(self) -> list[dict]:
        import ray

        return ray.get([e.weight_digests.remote() for e in self.engines])

    def shutdown(self) -> None:
        import ray

        for e in self.engines:
            ray.kill(e)
        self.engines = []
