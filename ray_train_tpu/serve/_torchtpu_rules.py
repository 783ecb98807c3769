"""vllm-torchtpu's rules that vLLM's CPU platform does not follow, kept by the
simulated TPU platform (`ray_train_tpu.serve._vllm_sim`).

Each rule is vllm-torchtpu `constants.VLLM_TORCHTPU_VERSION`'s, and
tests/unit/test_torchtpu_rules.py checks it against that version's own code
(`ray_train_tpu.serve._torchtpu_source`: its function run where it can run
here, its source read where it cannot), so that a version bump that changes a
rule fails a test:

- requests: seeded sampling is refused (``TpuPlatform.validate_request``,
  ``platforms/tpu_platform.py``; its sampler draws from one engine-wide
  generator), and every sampling type but greedy and random;
- the worker: ``TPUWorker`` (``worker/tpu_worker.py``) subclasses vLLM's
  ``WorkerBase``, not its GPU ``Worker``: the GPU worker's extra methods (the
  weight-transfer API, sleep mode, ...) do not exist there, and vLLM answers a
  ``collective_rpc`` of one with ``NotImplementedError``;
- the executor: chosen from ``TPU_MULTIHOST_BACKEND`` (and vLLM's
  ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND``) by ``TpuPlatform.check_and_update_config``,
  whatever ``distributed_executor_backend`` says;
- log-probs: ``TPUModelRunner.gather_logprobs`` takes them from the logits
  before temperature and the other sampling parameters, whatever
  ``logprobs_mode`` says (vllm-torchtpu never reads it): vLLM's ``raw_logprobs``.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from typing import Iterable, Mapping, Optional

from ray_train_tpu import constants as C

VERSION = C.VLLM_TORCHTPU_VERSION

# --- requests

SEED_REFUSAL = "JAX does not support per-request seed."


def validate_request(params) -> None:
    """vllm-torchtpu's ``TpuPlatform.validate_request`` for `params` (vLLM's
    ``SamplingParams`` or ``PoolingParams``): ValueError for what it refuses.
    Its own message first, then what to do instead."""
    from vllm.sampling_params import SamplingParams, SamplingType

    if not isinstance(params, SamplingParams):
        return
    if params.sampling_type == SamplingType.RANDOM_SEED:
        raise ValueError(
            f"{SEED_REFUSAL} (vllm-torchtpu {VERSION} refuses SamplingParams(seed={params.seed!r}) with "
            f"temperature {params.temperature}: its sampler draws from one engine-wide generator; drop the "
            "request's seed and seed the engine instead (vllm.LLM(seed=...), engine_kwargs={'seed': ...}))")
    if params.sampling_type not in (SamplingType.GREEDY, SamplingType.RANDOM):
        raise ValueError(f"Sampling type {params.sampling_type} is not supported on TPU.")


# --- the executor

MULTIHOST_BACKEND_ENV = "TPU_MULTIHOST_BACKEND"
MULTIHOST_BACKENDS = ("ray", "mp")  # its envs.py: env_with_choices("TPU_MULTIHOST_BACKEND", "", ["ray", "mp"])
UNIPROC = "uni"
MULTIPROC = "TpuMultiprocExecutor"
RAY_V2 = "RayDistributedExecutorV2"
RAY_V1 = "RayDistributedExecutor"
# What simulates each: vLLM's own executors of the same kind (``distributed_executor_backend``).
SIMULATED_EXECUTOR = {UNIPROC: "uni", MULTIPROC: "mp", RAY_V2: "ray"}


def multihost_backend(environ: Optional[Mapping[str, str]] = None) -> str:
    """``TPU_MULTIHOST_BACKEND`` as vllm-torchtpu reads it: ``""`` when unset,
    ValueError for a value but "ray" and "mp" (an empty one included)."""
    value = (os.environ if environ is None else environ).get(MULTIHOST_BACKEND_ENV)
    if value is None:
        return ""
    if value not in MULTIHOST_BACKENDS:
        raise ValueError(f"{MULTIHOST_BACKEND_ENV}={value!r}: vllm-torchtpu {VERSION} accepts "
                         f"{' or '.join(repr(v) for v in MULTIHOST_BACKENDS)}, or no value; use 'ray' for an engine "
                         "whose workers are Ray actors (across hosts)")
    return value


def torchtpu_executor(backend: str, use_ray_v2: bool, parallel) -> str:
    """The executor vllm-torchtpu's platform picks (`UNIPROC`, `MULTIPROC`,
    `RAY_V2` or `RAY_V1`) for ``TPU_MULTIHOST_BACKEND`` `backend`, vLLM's
    ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND`` and `parallel` (vLLM's
    ``ParallelConfig``; its ``distributed_executor_backend`` plays no part).
    NotImplementedError where it refuses."""
    pcp = getattr(parallel, "prefill_context_parallel_size", 1) or 1
    if backend != "ray" and parallel.nnodes > 1:
        return MULTIPROC
    if backend == "mp" or not backend:
        if (pcp <= 1 and parallel.data_parallel_size == 1 and parallel.pipeline_parallel_size == 1
                and parallel.tensor_parallel_size == 1):
            return UNIPROC
        return MULTIPROC
    if backend == "ray":
        if parallel.data_parallel_size > 1:
            if pcp > 1:
                raise NotImplementedError("Prefill context parallelism is not supported together with multihost "
                                          "data parallelism.")
            if not use_ray_v2:
                raise NotImplementedError("Multihost data parallelism requires the Ray V2 executor. Set "
                                          "VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1.")
        return RAY_V2 if use_ray_v2 else RAY_V1
    return UNIPROC


def simulated_executor(parallel, environ: Optional[Mapping[str, str]] = None) -> str:
    """vLLM's ``distributed_executor_backend`` that stands for the executor
    vllm-torchtpu would pick here (ValueError for one not simulated)."""
    env = os.environ if environ is None else environ
    # vLLM's envs.py: bool(int(os.getenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1")))
    chosen = torchtpu_executor(multihost_backend(env), bool(int(env.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1"))),
                               parallel)
    if chosen == MULTIPROC and parallel.nnodes > 1:
        raise ValueError(f"{MULTIHOST_BACKEND_ENV}={env.get(MULTIHOST_BACKEND_ENV, '')!r} with nnodes="
                         f"{parallel.nnodes}: vllm-torchtpu would start one multiprocess executor per host "
                         "(`vllm serve --nnodes`), which is not simulated; set TPU_MULTIHOST_BACKEND=ray")
    if chosen not in SIMULATED_EXECUTOR:
        raise ValueError(f"vllm-torchtpu would run {chosen} here (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0), which is not "
                         "simulated: set VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1")
    return SIMULATED_EXECUTOR[chosen]


# --- log-probs

LOGPROBS_MODE = "raw_logprobs"  # vLLM's name for log_softmax of the logits before any processing


# --- the worker's methods

# TPUWorker's own methods in vllm-torchtpu VERSION (worker/tpu_worker.py; the
# test reads them from that source and fails if they differ). TPUWorker's other
# methods are vLLM's WorkerBase's.
TPU_WORKER_METHODS = frozenset({
    "__init__", "_next_profile_session_key", "_pooling_kv_cache_cap_bytes", "compile_or_warm_up_model",
    "determine_available_memory", "execute_dummy_batch", "execute_model", "get_kv_cache_spec",
    "get_kv_connector_handshake_metadata", "get_kv_prewarm_shapes", "get_model", "get_node_kv_ip_port",
    "get_num_gpu_blocks_override", "get_supported_tasks", "init_device", "initialize_cache",
    "initialize_from_config", "load_model", "pp_drains_before_handoff", "pp_push", "pp_settle",
    "prewarm_kv_offload_shape", "profile", "profile_pipeline_chunks", "reload_kernels", "sample_tokens",
    "set_kv_cache_layout", "sync_weights", "take_draft_token_ids",
})


def _self_calls(cls: type, name: str) -> set:
    """Attribute names ``self.<x>`` the method `name` of `cls` reads."""
    try:
        source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
    except (AttributeError, TypeError, OSError):
        return set()
    return {n.attr for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}


def gpu_only_methods(worker_cls: type, worker_base: type, tpu_methods: Iterable[str] = TPU_WORKER_METHODS) -> frozenset:
    """The public methods `worker_cls` (vLLM's CPU worker: its GPU ``Worker``
    and what the CPU worker adds) has that ``TPUWorker`` (`tpu_methods` and
    `worker_base`, vLLM's ``WorkerBase``) has not. Kept apart: the ones the
    kept methods themselves call (``execute_model`` calls
    ``annotate_profile``; TPUWorker's does that work inline), so the CPU
    worker still runs."""
    tpu = set(tpu_methods) | {n for n in dir(worker_base) if callable(getattr(worker_base, n, None))}
    classes = [k for k in worker_cls.__mro__ if issubclass(k, worker_base) and k is not worker_base]
    own = {n for k in classes for n, v in vars(k).items() if callable(v) or isinstance(v, (classmethod, staticmethod))}
    candidates = {n for n in own - tpu if not n.startswith("_")}
    # Methods reached from the kept ones (and from private helpers they call).
    reached, todo = set(), [n for n in own if n not in candidates]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo.extend(n for n in _self_calls(worker_cls, name) if n in own and n not in reached)
    return frozenset(candidates - reached)


class _Absent:
    """A method TPUWorker does not have: looking it up raises AttributeError
    (vLLM's ``collective_rpc`` then raises NotImplementedError, as on TPUs)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        raise AttributeError(f"{owner.__name__ if owner else 'worker'} has no {self.name!r}: vllm-torchtpu "
                             f"{VERSION}'s TPUWorker does not implement it (a method of vLLM's GPU Worker only; "
                             "simulated TPU platform)")


def hide_methods(cls: type, names: Iterable[str]) -> type:
    """`cls` without `names` (each now an `_Absent`)."""
    for name in names:
        setattr(cls, name, _Absent(name))
    cls._torchtpu_hidden = frozenset(names)
    return cls
