"""Build the ``LLMConfig`` and OpenAI app that serve a model on TPU slices with
Ray Serve LLM's own vLLM engine (no custom server or engine class)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from ray_train_tpu.serve.engine import slice_engine, with_env

CALLBACK_CLASS = "ray_train_tpu.serve._callback.SliceLayoutCallback"
# A replica on a sub-slice reserves it itself (``LLMConfig.server_cls``).
SUBSLICE_SERVER_CLASS = "ray_train_tpu.serve._subslice.SubsliceLLMServer"
# Ray Serve LLM's own default target is 1e9 ongoing requests per replica, which
# never scales on load; a replica that owns a slice is asked to carry this many.
DEFAULT_TARGET_ONGOING_REQUESTS = 16


def build_llm_config(
    model: str,
    topology: str,
    accelerator_type: str,
    *,
    model_id: Optional[str] = None,
    num_replicas: Optional[int] = None,
    autoscaling_config: Optional[Mapping[str, Any]] = None,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    engine_kwargs: Optional[dict] = None,
    deployment_config: Optional[dict] = None,
    runtime_env: Optional[dict] = None,
    lora_config: Optional[Mapping[str, Any]] = None,
    log_engine_metrics: bool = False,
    simulate: Optional[bool] = None,
    engine_shape: Optional[str] = None,
) -> Any:
    """A ``ray.serve.llm.LLMConfig`` for Ray Serve LLM's vLLM engine whose every
    replica owns one whole slice, or one `engine_shape` piece of one, one vLLM
    worker per device.

    Checked before anything starts: the slice (accelerator type, topology),
    TP x PP against the slice's devices and the model's heads and layers
    (unset sizes are chosen: the largest TP the model allows), the replica
    count or autoscaling bounds, and, on the simulated platform, that the
    engine can serve at all (no pipeline parallelism in eager mode).

    Args:
        model: Hugging Face model directory (as every TPU host sees it) or id.
        topology, accelerator_type: each replica's slice, e.g. ``"4x4"``, ``"TPU-V6E"``.
        model_id: the name clients send (default: the directory's name).
        num_replicas: replicas, one slice (or one `engine_shape` piece) each
            (default 1, or with `engine_shape` as many pieces as one slice
            holds; not with autoscaling).
        autoscaling_config: Ray Serve's ``autoscaling_config``; ``min_replicas``
            and ``max_replicas`` count slices (or pieces). A replica that cannot
            get a whole free slice (piece) waits for one; scaling down releases it.
            ``target_ongoing_requests`` defaults to 16 per replica (Ray Serve
            LLM's own default never scales on load).
        tensor_parallel_size, pipeline_parallel_size: default: sized to the slice.
        engine_kwargs: more vLLM engine arguments (``max_model_len``, ``dtype``,
            ``enforce_eager``, ...).
        lora_config: Ray Serve LLM's ``lora_config`` (adapters loaded from
            ``dynamic_lora_loading_path``, a cloud storage path); sets
            ``enable_lora`` unless ``engine_kwargs`` says otherwise.
        log_engine_metrics: export vLLM's engine metrics through Ray's metrics.
        simulate: the simulated TPU platform (vLLM's CPU kernels, gloo) instead of
            vllm-torchtpu; default: ``RAY_TRAIN_TPU_SIMULATE=1`` in this process.
        engine_shape: each replica's piece of a `topology` slice, so that
            several replicas fill one slice (``serve --plan`` prints the
            smallest that holds the model): ``"1x1x1"`` (one v4 chip),
            ``"2x2x1"`` (one v4 host, Ray's ``SubslicePlacementGroup``), ...
            (`ray_train_tpu.serve.subslice`). Default: the whole slice.

    Example:
        >>> cfg = build_llm_config("/models/Qwen2.5-0.5B-Instruct", "4x4", "TPU-V6E",  # doctest: +SKIP
        ...                        autoscaling_config={"min_replicas": 1, "max_replicas": 4})
        >>> serve.run(build_openai_app([cfg]))  # doctest: +SKIP
    """
    kwargs = dict(engine_kwargs or {})
    if lora_config is not None:
        kwargs.setdefault("enable_lora", True)
    engine = slice_engine(model, topology, accelerator_type, tensor_parallel_size=tensor_parallel_size,
                          pipeline_parallel_size=pipeline_parallel_size, engine_kwargs=kwargs, simulate=simulate,
                          engine_shape=engine_shape)
    spec = engine.spec
    sub = getattr(spec, "engine_shape", None)
    if sub is not None and num_replicas is None and autoscaling_config is None \
            and "num_replicas" not in (deployment_config or {}) and "autoscaling_config" not in (deployment_config or {}):
        num_replicas = spec.shape.count  # fill one slice
    deployment = _deployment_config(num_replicas, autoscaling_config, deployment_config)
    from ray_train_tpu._compat import ray_llm as R

    extra = {} if lora_config is None else {"lora_config": dict(lora_config)}
    callback_kwargs = {"topology": spec.topology, "accelerator_type": spec.accelerator_type}
    if sub is not None:
        extra["server_cls"] = SUBSLICE_SERVER_CLASS
        callback_kwargs["engine_shape"] = sub
    return R.LLMConfig(
        model_loading_config={"model_id": model_id or _default_id(model), "model_source": model},
        accelerator_type=spec.accelerator_type,
        accelerator_config={"kind": "tpu", "topology": spec.topology},
        placement_group_config={"bundle_per_worker": {"TPU": 1}, "strategy": engine.strategy},
        engine_kwargs=engine.engine_kwargs,
        deployment_config=deployment,
        runtime_env=with_env(runtime_env, engine.env),
        callback_config={
            "callback_class": CALLBACK_CLASS,
            "callback_kwargs": callback_kwargs,
        },
        log_engine_metrics=bool(log_engine_metrics),
        **extra,
    )


def _deployment_config(num_replicas, autoscaling_config, deployment_config) -> dict:
    """Ray Serve's deployment options: a fixed replica count or autoscaling
    bounds, never both (Serve refuses ``num_replicas`` beside ``autoscaling_config``)."""
    out = dict(deployment_config or {})
    autoscaling = autoscaling_config if autoscaling_config is not None else out.pop("autoscaling_config", None)
    replicas = num_replicas if num_replicas is not None else out.pop("num_replicas", None)
    if autoscaling is not None and replicas is not None:
        raise ValueError(
            f"num_replicas {replicas!r} and autoscaling_config {dict(autoscaling)!r} are both given: a deployment "
            "either has a fixed replica count or scales between min_replicas and max_replicas; give one"
        )
    if autoscaling is None:
        replicas = 1 if replicas is None else replicas
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"num_replicas {replicas!r} must be an integer >= 1 (one slice, or engine_shape piece, each)")
        return {**out, "num_replicas": replicas}
    auto = dict(autoscaling)
    lo, hi = auto.get("min_replicas", 1), auto.get("max_replicas")
    for name, value in (("min_replicas", lo), ("max_replicas", hi)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"autoscaling_config {name} {value!r} must be an integer >= 0 (slices)")
    if hi < max(lo, 1):
        raise ValueError(f"autoscaling_config max_replicas {hi} must be >= min_replicas {lo} and >= 1")
    auto.setdefault("target_ongoing_requests", DEFAULT_TARGET_ONGOING_REQUESTS)
    return {**out, "autoscaling_config": auto}


def build_openai_app(llm_configs: list, **serving_args: Any) -> Any:
    """Ray Serve LLM's OpenAI app (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/models``) for `llm_configs`; an unknown model gets an OpenAI-style
    error."""
    from ray_train_tpu._compat import ray_llm as R

    serving_args.setdefault("ingress_cls_config", {"ingress_cls": R.OpenAiErrorsIngress})
    return R.build_openai_app({"llm_configs": list(llm_configs), **serving_args})


def _default_id(model: str) -> str:
    return os.path.basename(model.rstrip("/")) if os.path.exists(model) else model
