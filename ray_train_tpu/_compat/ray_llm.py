"""Every touch of Ray Serve LLM's internals (``ray.llm._internal.serve``),
pinned to `constants.RAY_VERSION`.

Serving (Ray Serve LLM):

- `CallbackBase`: the base of Ray Serve LLM's replica callbacks
  (``callback_config``); ``self.ctx.placement_group`` is the replica's slice
  placement group, ``self.llm_config`` its config, ``self.ctx.run_init_node``
  whether Ray downloads the model on every node first.
- `OpenAiErrorsIngress`: Ray's OpenAI ingress (``OpenAiIngress``), except that an
  unknown model gets an OpenAI-style error (Ray 2.60 raises a plain
  ``HTTPException``, which FastAPI answers with ``{"detail": ...}``).
- `TELEMETRY_ACTOR_CLASS`: Ray's detached usage-telemetry actor, which outlives
  every app and batch job by design.
- `LLMServer` (public, ``ray.serve.llm.deployment``; ``LLMConfig.server_cls``
  names a subclass) and `use_placement_group`: a replica that reserved its own
  placement group (a sub-slice) hands it to Ray Serve LLM, whose vLLM engine
  config otherwise asks its TPU backend for a whole slice
  (``VLLMEngineConfig._accelerator``, ``TPUAccelerator.create_placement_group``).

Batch inference's seams (Ray Data LLM) are in `ray_train_tpu._compat.ray_data`, which
leaves vLLM out of the driver.

Importing this module imports ``ray.serve.llm`` and so vLLM, which picks its
platform on import (`ray_train_tpu.serve.platforms`): the driver needs
``RAY_TRAIN_TPU_SIMULATE=1`` in simulation, vllm-torchtpu on a TPU host, and
nothing on a CPU-only head.
"""

from __future__ import annotations

from typing import Any, Callable

from ray_train_tpu import constants as C
from ray_train_tpu._compat.vllm import log_to_stderr

TESTED_RAY_VERSION = C.RAY_VERSION

log_to_stderr()  # before ray.serve.llm imports vLLM

import ray  # noqa: E402
from fastapi import HTTPException  # noqa: E402
from ray.llm._internal.common.callbacks.base import CallbackBase  # noqa: E402
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException  # noqa: E402
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress  # noqa: E402
from ray.llm._internal.serve.core.configs.accelerators import TPUAccelerator  # noqa: E402
from ray.serve.llm import LLMConfig, build_openai_app  # noqa: E402
from ray.serve.llm.deployment import LLMServer  # noqa: E402

__all__ = [
    "TELEMETRY_ACTOR_CLASS", "TESTED_RAY_VERSION", "CallbackBase", "LLMConfig", "LLMServer", "OpenAiErrorsIngress",
    "build_openai_app", "use_placement_group",
]

TELEMETRY_ACTOR_CLASS = "TelemetryAgent"
if ray.__version__ != TESTED_RAY_VERSION:
    import logging

    logging.getLogger(__name__).warning(
        "ray_train_tpu's Ray Serve LLM seams were checked against Ray %s, found %s; "
        "tests/unit/test_compat.py tells whether they still hold", TESTED_RAY_VERSION, ray.__version__)


class OpenAiErrorsIngress(OpenAiIngress):
    """Ray's OpenAI ingress, except that an unknown or missing model gets an
    OpenAI-style error (``{"error": {...}}``)."""

    async def _get_model_id(self, model):
        try:
            return await super()._get_model_id(model)
        except HTTPException as e:
            kind = "NotFoundError" if e.status_code == 404 else "BadRequestError"
            raise OpenAIHTTPException(status_code=e.status_code, message=str(e.detail), type=kind) from None


class _ReservedTPU(TPUAccelerator):
    """Ray Serve LLM's TPU backend, handing out a placement group that the
    replica already reserved instead of reserving a whole slice."""

    def __init__(self, config: Any, placement_group: Any, release: Callable[[], None]):
        super().__init__(config)
        self._reserved, self._release = placement_group, release

    def create_placement_group(self, *, bundles, strategy, name, accelerator_type_str=None):
        return self._reserved

    def shutdown(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def use_placement_group(llm_config: Any, placement_group: Any, release: Callable[[], None]) -> None:
    """Make the replica's vLLM engine (`llm_config`'s, in this process) run in
    `placement_group`, which `release` gives back. Call before the engine starts
    (``LLMServer.start``)."""
    engine_config = llm_config.get_engine_config()  # cached on the LLMConfig
    if not isinstance(engine_config.accelerator, TPUAccelerator):
        raise TypeError(f"use_placement_group: the engine's accelerator is {engine_config.accelerator!r}, not TPU")
    engine_config._accelerator = _ReservedTPU(engine_config.accelerator_config, placement_group, release)
