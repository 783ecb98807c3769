"""Build the ``LLMConfig`` and OpenAI app that serve a model on TPU slices with
Ray Serve LLM's own vLLM engine (no custom server or engine class)."""

from __future__ import annotations

import os
from typing import Any, Optional

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu.serve.models import model_shape
from ray_train_tpu.serve.spec import SliceServeSpec

CALLBACK_CLASS = "ray_train_tpu.serve._callback.SliceLayoutCallback"
# Per-worker KV cache in simulation (CPU memory; vLLM's CPU default is 4 GiB).
SIMULATED_KV_CACHE_BYTES = 256 * 2**20

# Every replica and vLLM worker: libtpu never asks for a metadata server.
SERVE_ENV = {C.TPU_SKIP_MDS_QUERY: "1"}
# vllm-torchtpu: its Ray executor (V2) for a multi-host slice
# (vllm_torchtpu/platforms/tpu_platform.py, TPU_MULTIHOST_BACKEND).
TORCHTPU_ENV = {"TPU_MULTIHOST_BACKEND": "ray", "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}
# Simulation: gloo over loopback (each simulated host is a loopback address),
# no CPU pinning (the hosts share the machine's cores), torch_tpu not autoloaded.
SIMULATED_ENV = {
    C.RAY_TRAIN_TPU_SIMULATE: "1",
    C.TORCH_DEVICE_BACKEND_AUTOLOAD: "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def build_llm_config(
    model: str,
    topology: str,
    accelerator_type: str,
    *,
    model_id: Optional[str] = None,
    num_replicas: int = 1,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    engine_kwargs: Optional[dict] = None,
    deployment_config: Optional[dict] = None,
    runtime_env: Optional[dict] = None,
    simulate: Optional[bool] = None,
) -> Any:
    """A ``ray.serve.llm.LLMConfig`` for Ray Serve LLM's vLLM engine whose every
    replica owns one whole slice, one vLLM worker per device.

    Checked before anything starts: the slice (accelerator type, topology),
    and TP x PP against the slice's devices and the model's heads and layers
    (unset sizes are chosen: the largest TP the model allows).

    Args:
        model: Hugging Face model directory (as every TPU host sees it) or id.
        topology, accelerator_type: each replica's slice, e.g. ``"4x4"``, ``"TPU-V6E"``.
        model_id: the name clients send (default: the directory's name).
        num_replicas: replicas, one slice each.
        tensor_parallel_size, pipeline_parallel_size: default: sized to the slice.
        engine_kwargs: more vLLM engine arguments (``max_model_len``, ``dtype``,
            ``enforce_eager``, ...).
        simulate: the simulated TPU platform (vLLM's CPU kernels, gloo) instead of
            vllm-torchtpu; default: ``RAY_TRAIN_TPU_SIMULATE=1`` in this process.

    Example:
        >>> cfg = build_llm_config("/models/Qwen2.5-0.5B-Instruct", "4x4", "TPU-V6E")  # doctest: +SKIP
        >>> serve.run(build_openai_app([cfg]))  # doctest: +SKIP
    """
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas {num_replicas!r} must be an integer >= 1 (one slice each)")
    kwargs = dict(engine_kwargs or {})
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if value is not None and kwargs.get(name, value) != value:
            raise ValueError(f"{name} is {value!r} but engine_kwargs[{name!r}] is {kwargs[name]!r}; give it once")
        if value is not None:
            kwargs[name] = value
    if kwargs.get("distributed_executor_backend", "ray") != "ray":
        raise ValueError(
            f"engine_kwargs distributed_executor_backend {kwargs['distributed_executor_backend']!r}: "
            "a replica's workers span the slice's hosts, which needs vLLM's Ray executor ('ray'); remove it"
        )
    spec = SliceServeSpec(
        accelerator_type=accelerator_type,
        topology=topology,
        tensor_parallel_size=kwargs.get("tensor_parallel_size"),
        pipeline_parallel_size=kwargs.get("pipeline_parallel_size"),
        model=model_shape(model),
    )
    kwargs.update(
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        distributed_executor_backend="ray",
    )
    if simulate is None:
        simulate = _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"
    env = dict(SERVE_ENV)
    if os.path.isdir(model):
        env[C.HF_HUB_OFFLINE] = "1"
    if simulate:
        env.update(SIMULATED_ENV)
        if "kv_cache_memory_bytes" not in kwargs and "VLLM_CPU_KVCACHE_SPACE" not in env:
            kwargs["kv_cache_memory_bytes"] = SIMULATED_KV_CACHE_BYTES
    else:
        env.update(TORCHTPU_ENV)
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
    from ray_train_tpu.serve import _ray_llm as R

    return R.LLMConfig(
        model_loading_config={"model_id": model_id or _default_id(model), "model_source": model},
        accelerator_type=spec.accelerator_type,
        accelerator_config={"kind": "tpu", "topology": spec.topology},
        placement_group_config={"bundle_per_worker": {"TPU": 1}},
        engine_kwargs=kwargs,
        deployment_config={"num_replicas": num_replicas, **(deployment_config or {})},
        runtime_env=runtime_env,
        callback_config={
            "callback_class": CALLBACK_CLASS,
            "callback_kwargs": {"topology": spec.topology, "accelerator_type": spec.accelerator_type},
        },
        log_engine_metrics=False,
    )


def build_openai_app(llm_configs: list, **serving_args: Any) -> Any:
    """Ray Serve LLM's OpenAI app (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/models``) for `llm_configs`; an unknown model gets an OpenAI-style
    error."""
    from ray_train_tpu.serve import _ray_llm as R

    serving_args.setdefault("ingress_cls_config", {"ingress_cls": R.OpenAiErrorsIngress})
    return R.build_openai_app({"llm_configs": list(llm_configs), **serving_args})


def _default_id(model: str) -> str:
    return os.path.basename(model.rstrip("/")) if os.path.exists(model) else model
