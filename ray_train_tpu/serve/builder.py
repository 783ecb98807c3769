"""Build the ``LLMConfig`` and OpenAI app that serve a model on TPU slices."""

from __future__ import annotations

import os
from typing import Any, Optional

from ray_train_tpu import constants as C
from ray_train_tpu.serve.spec import SliceServeSpec


def build_llm_config(
    model: str,
    topology: str,
    accelerator_type: str,
    *,
    model_id: Optional[str] = None,
    num_replicas: int = 1,
    engine_kwargs: Optional[dict] = None,
    deployment_config: Optional[dict] = None,
    runtime_env: Optional[dict] = None,
) -> Any:
    """A ``ray.serve.llm.LLMConfig`` whose every replica owns one whole slice.

    Args:
        model: Hugging Face model id, local directory or ``.gguf`` file, as
            every TPU host sees it.
        topology, accelerator_type: the slice of each replica, e.g. ``"4x4"``,
            ``"TPU-V6E"``.
        model_id: the name clients use (default: the file or directory name).
        num_replicas: replicas, one slice each.
        engine_kwargs: more engine options (``tensor_parallel_size`` must be the
            slice's device count, its default; ``dtype``, ``max_model_len``).

    Example:
        >>> from ray_train_tpu.serve import build_llm_config, build_openai_app  # doctest: +SKIP
        >>> cfg = build_llm_config("Qwen/Qwen2.5-0.5B-Instruct", "4x4", "TPU-V6E")  # doctest: +SKIP
        >>> serve.run(build_openai_app({"llm_configs": [cfg]}))  # doctest: +SKIP
    """
    kwargs = dict(engine_kwargs or {})
    spec = SliceServeSpec(
        accelerator_type=accelerator_type,
        topology=topology,
        tensor_parallel_size=kwargs.get("tensor_parallel_size"),
        pipeline_parallel_size=kwargs.get("pipeline_parallel_size", 1),
    )
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas {num_replicas!r} must be an integer >= 1 (one slice each)")
    kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
    from ray_train_tpu.serve import _ray_llm as R
    from ray_train_tpu.serve.engine import TorchTPULLMServer

    env = dict(R.SERVE_ENV)
    if os.path.exists(model):
        env[C.HF_HUB_OFFLINE] = "1"
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
    return R.LLMConfig(
        model_loading_config={"model_id": model_id or _default_id(model), "model_source": model},
        accelerator_type=spec.accelerator_type,
        accelerator_config={"kind": "tpu", "topology": spec.topology},
        engine_kwargs=kwargs,
        deployment_config={"num_replicas": num_replicas, **(deployment_config or {})},
        runtime_env=runtime_env,
        server_cls=TorchTPULLMServer,
        log_engine_metrics=False,
    )


def build_openai_app(llm_configs: list, **serving_args: Any) -> Any:
    """Ray Serve LLM's OpenAI app (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/models``) for `llm_configs`; its ingress gets ``VLLM_TARGET_DEVICE=cpu``
    and answers an unknown model with an OpenAI-style error."""
    from ray_train_tpu.serve import _ray_llm as R

    ingress = dict(serving_args.pop("ingress_deployment_config", {}) or {})
    actor = dict(ingress.get("ray_actor_options", {}))
    renv = dict(actor.get("runtime_env", {}))
    renv["env_vars"] = {**R.SERVE_ENV, **renv.get("env_vars", {})}
    actor["runtime_env"] = renv
    ingress["ray_actor_options"] = actor
    serving_args.setdefault("ingress_cls_config", {"ingress_cls": R.OpenAiErrorsIngress})
    return R.build_openai_app(
        {"llm_configs": list(llm_configs), "ingress_deployment_config": ingress, **serving_args}
    )


def _default_id(model: str) -> str:
    name = os.path.basename(model.rstrip("/")) if os.path.exists(model) else model
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
