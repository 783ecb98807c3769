"""`RolloutPool`: the engines of the rollout slice, their share of each step,
weight loads, and retries of an engine that dies."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ray_train_tpu.rl.config import SamplingConfig
from ray_train_tpu.rl.rollout import EngineLayout, RolloutEngine, engine_seed

logger = logging.getLogger(__name__)


def _is_actor_failure(e: BaseException) -> bool:
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError))


class Rollout:
    """A step's generate calls in flight (`RolloutPool.submit`)."""

    def __init__(self, requests: list, sampling: SamplingConfig, shares: list, refs: dict):
        self.requests, self.sampling, self.shares, self.refs = requests, sampling, shares, refs
        self.result: Optional[tuple[list, int]] = None  # set once collected


class RolloutPool:
    """Engines on a `SliceReservation` laid out by an `EngineLayout`."""

    def __init__(self, reservation, layout: EngineLayout, engine_kwargs: dict, *, max_retries: int = 2,
                 slice_plan: Optional[str] = None):
        self.reservation, self.layout, self.engine_kwargs = reservation, layout, dict(engine_kwargs)
        self.max_retries, self.slice_plan = max_retries, slice_plan
        self.engines: list = []
        self.restarts = 0
        self._incarnations: list = []  # per engine, how many times it was started
        self._weights: Optional[list] = None  # the last weights loaded (bucket refs)
        self._version = 0
        self._mailbox = None
        self._specs: Optional[dict] = None

    @property
    def num_engines(self) -> int:
        return self.layout.num_engines

    def start(self) -> None:
        import uuid

        import ray

        from ray_train_tpu.rl.weights import WeightMailbox

        self.mailbox_name = f"ray_train_tpu-grpo-weights-{uuid.uuid4().hex[:12]}"
        self._mailbox = ray.remote(WeightMailbox).options(name=self.mailbox_name, num_cpus=0).remote()
        self._incarnations = [0] * self.num_engines
        self.engines = [self._new_engine(i) for i in range(self.num_engines)]
        ray.get([e.pid.remote() for e in self.engines])

    def _new_engine(self, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        devices = [self.reservation.devices[d] for d in self.layout.devices(index)]
        tp = self.layout.tensor_parallel_size
        strategy = PlacementGroupSchedulingStrategy(self.reservation.placement_group,
                                                    placement_group_bundle_index=devices[0].bundle,
                                                    placement_group_capture_child_tasks=tp > 1)
        resources = {} if tp > 1 else {"TPU": 1}  # with TP the Ray executor's workers hold the chips
        kwargs = dict(self.engine_kwargs)
        kwargs["seed"] = engine_seed(kwargs.get("seed", 0), index, self._incarnations[index])
        cls = ray.remote(RolloutEngine)
        return cls.options(num_cpus=1, resources=resources, scheduling_strategy=strategy, max_restarts=0).remote(
            **kwargs, tensor_parallel_size=tp, bundle_indices=[d.bundle for d in devices],
            expected_places=[(d.node_ip, d.chip) for d in devices],
            slice_plan=self.slice_plan if self.num_engines == 1 else None,
            slice_name=devices[0].slice_name if tp == 1 else None)

    def _restart(self, index: int) -> None:
        import ray

        self._incarnations[index] += 1
        logger.warning("rollout engine %d died; starting a new one on the same devices with a new sampling seed "
                       "(%d): its share of this step is re-drawn, not replayed (vllm-torchtpu has no per-request "
                       "seeds), so the step's samples differ from a run without the failure", index,
                       engine_seed(self.engine_kwargs.get("seed", 0), index, self._incarnations[index]))
        ray.kill(self.engines[index])
        self.engines[index] = self._new_engine(index)
        self.restarts += 1
        if self._weights is not None:  # the newest weights, not the ones on disk
            ray.get(self.engines[index].load_weights.remote(self.mailbox_name, self._version))

    # --- generation

    def submit(self, requests: list, sampling: SamplingConfig) -> Rollout:
        """Start generating; `collect` waits for the completions."""
        n = self.num_engines
        shares = [requests[i::n] for i in range(n)]
        refs = {i: self.engines[i].generate.remote(s, sampling) for i, s in enumerate(shares) if s}
        return Rollout(requests, sampling, shares, refs)

    def collect(self, rollout: Rollout) -> tuple[list, int]:
        """Completions of every request (in order) and how many shares were retried."""
        import ray

        if rollout.result is not None:
            return rollout.result
        pending, results, retries = dict(rollout.refs), {}, 0
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                results[i] = ray.get(ref)
                del pending[i]
            except Exception as e:
                if not _is_actor_failure(e):
                    raise
                retries += 1
                if retries > self.max_retries:
                    raise RuntimeError(f"rollout failed {retries} times in one step; last: {e}") from e
                self._restart(i)
                pending[i] = self.engines[i].generate.remote(rollout.shares[i], rollout.sampling)
        out = [None] * len(rollout.requests)
        for i, share in results.items():
            for j, completions in enumerate(share):
                out[i + j * self.num_engines] = completions
        rollout.result = (out, retries)
        return rollout.result

    def generate(self, requests: list, sampling: SamplingConfig,
                 on_submitted: Optional[Callable[[], None]] = None) -> tuple[list, int]:
        rollout = self.submit(requests, sampling)
        if on_submitted is not None:
            on_submitted()
        return self.collect(rollout)

    # --- weights

    def sync(self, buckets: list) -> float:
        """Every engine loads ``buckets``; returns the slowest engine's seconds."""
        import ray

        self._weights = buckets
        self._version += 1
        ray.get(self._mailbox.put.remote(self._version, [buckets]))
        refs = [e.load_weights.remote(self.mailbox_name, self._version) for e in self.engines]
        seconds = []
        for i, ref in enumerate(refs):
            try:
                seconds.append(ray.get(ref))
            except Exception as e:
                if not _is_actor_failure(e):
                    raise
                self._restart(i)  # loads `buckets` into the new engine
        return max(seconds, default=0.0)

    def prefetch(self, buckets: list) -> None:
        """Start moving ``buckets`` to every engine host's object store now
        (while the engines are busy), so that their load finds them local."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = [r for bucket in buckets for r in bucket]
        task = ray.remote(_fetch_here)
        for node_id in {d.node_id for d in self.reservation.devices}:
            task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                         ).remote([refs])

    def tp_specs(self) -> Optional[dict]:
        """``{hf name: [slice of TP rank r]}`` of the engines (None without TP)."""
        import ray

        if self.layout.tensor_parallel_size == 1:
            return None
        if self._specs is None:
            per_rank = ray.get(self.engines[0].tp_specs.remote())
            self._specs = {name: [rank[name] for rank in per_rank] for name in per_rank[0]}
        return self._specs

    def digests(self) -> list[dict]:
        import ray

        return ray.get([e.weight_digests.remote() for e in self.engines])

    def shutdown(self) -> None:
        import ray

        for e in self.engines + ([self._mailbox] if self._mailbox is not None else []):
            ray.kill(e)
        self.engines, self._mailbox = [], None


def _fetch_here(wrapped: list) -> None:
    import ray

    refs = wrapped[0]
    ray.wait(refs, num_returns=len(refs), fetch_local=True)
