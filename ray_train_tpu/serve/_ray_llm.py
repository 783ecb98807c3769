"""Every touch of Ray Serve LLM internals, in one module, pinned to Ray 2.60.0.

Importing ``ray.serve.llm`` imports vLLM, which picks its platform on import
(`ray_train_tpu.serve.platforms`): the driver needs ``RAY_TRAIN_TPU_SIMULATE=1``
in simulation, vllm-torchtpu on a TPU host, and nothing on a CPU-only head.
"""

from __future__ import annotations

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

TESTED_RAY_VERSION = "2.60.0"

_environ.update({
    k: v for k, v in {C.VLLM_LOGGING_STREAM: "ext://sys.stderr"}.items() if _environ.get(k) is None
})

from fastapi import HTTPException  # noqa: E402
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException  # noqa: E402
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress  # noqa: E402
from ray.serve.llm import LLMConfig, build_openai_app  # noqa: E402

__all__ = ["LLMConfig", "OpenAiErrorsIngress", "build_openai_app", "TELEMETRY_ACTOR_CLASS"]

# Ray Serve LLM's detached usage-telemetry actor: it outlives every app by design.
TELEMETRY_ACTOR_CLASS = "TelemetryAgent"


class OpenAiErrorsIngress(OpenAiIngress):
    """Ray's OpenAI ingress, except that an unknown or missing model gets an
    OpenAI-style error (``{"error": {...}}``): Ray 2.60 raises a plain
    ``HTTPException`` there, which FastAPI answers with ``{"detail": ...}``."""

    async def _get_model_id(self, model):
        try:
            return await super()._get_model_id(model)
        except HTTPException as e:
            kind = "NotFoundError" if e.status_code == 404 else "BadRequestError"
            raise OpenAIHTTPException(status_code=e.status_code, message=str(e.detail), type=kind) from None
