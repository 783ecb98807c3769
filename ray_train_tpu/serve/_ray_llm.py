"""Every touch of Ray Serve LLM internals, in one module, pinned to Ray 2.60.0.

Importing ``ray.serve.llm`` imports vLLM's OpenAI protocol classes
(``ray/llm/_internal/serve/core/configs/openai_api_models.py``). vLLM is
installed without its dependencies (its wheel pins CUDA packages; see
README "Serving"), and with libtpu installed vLLM believes it runs on a TPU
unless ``VLLM_TARGET_DEVICE=cpu``: we only use its request/response models,
so every process that imports it gets ``VLLM_TARGET_DEVICE=cpu`` first.
"""

from __future__ import annotations

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

TESTED_RAY_VERSION = "2.60.0"

# What every process that imports ray.serve.llm must carry (replicas included).
SERVE_ENV = {C.VLLM_TARGET_DEVICE: "cpu", C.TPU_SKIP_MDS_QUERY: "1"}

_environ.update({
    k: v
    for k, v in {C.VLLM_TARGET_DEVICE: "cpu", C.VLLM_LOGGING_STREAM: "ext://sys.stderr"}.items()
    if _environ.get(k) is None
})

from fastapi import HTTPException  # noqa: E402
from ray.llm._internal.serve.core.configs.openai_api_models import (  # noqa: E402
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    OpenAIHTTPException,
)
from ray.llm._internal.serve.core.engine.protocol import LLMEngine  # noqa: E402
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress  # noqa: E402
from ray.serve.llm import LLMConfig, LLMServer, build_openai_app  # noqa: E402

__all__ = [
    "SERVE_ENV",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "CompletionResponse",
    "CompletionStreamResponse",
    "ErrorInfo",
    "ErrorResponse",
    "LLMConfig",
    "LLMEngine",
    "LLMServer",
    "OpenAiErrorsIngress",
    "build_openai_app",
]

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
