"""`TorchTPUEngine`: a Ray Serve LLM engine that runs a Hugging Face causal LM
with native PyTorch on a whole TPU slice; `TorchTPULLMServer` plugs it in.

``start()`` takes the slice placement group that Ray Serve LLM's
``TPUAccelerator`` reserves for the replica (a head placement group on the
slice's worker 0, then one bundle per host, gang-scheduled by slice name),
waits for a whole free slice rather than taking part of one, starts one
`HostWorker` per bundle pinned to it, orders them by TPU worker id, gives each
the TorchTPU environment from `launch_env` (the training backend's code path),
and loads the model on the lead host's device.

What runs where: generation runs on the lead host (TPU worker id 0); the other
hosts are reserved, placed and configured, but the model is not sharded
across them. Multi-host tensor parallelism on a real TPU slice is not
implemented and untested here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncGenerator, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_train_tpu import constants as C
from ray_train_tpu.launch_env import launch_envs
from ray_train_tpu.serve import _ray_llm as R
from ray_train_tpu.serve.host_worker import HostWorker
from ray_train_tpu.serve.spec import SliceServeSpec

logger = logging.getLogger(__name__)

# Ray sets these for the chips a worker holds; a host worker holds all of its host's.
_KEEP_RAY_KEYS = (C.TPU_VISIBLE_CHIPS,)
# Host workers are named actors here, "<prefix><model id>:<replica>:bundle<i>".
HOST_WORKER_NAMESPACE = "ray_train_tpu.serve"
HOST_WORKER_PREFIX = "host:"
HOST_WORKER_CONCURRENCY = 8
# Serve's health check times out after 10 s (RAY_SERVE_LLM_DEFAULT_HEALTH_CHECK_TIMEOUT_S).
HEALTH_PING_TIMEOUT_S = 8.0


def host_order(reports: list[dict], spec: SliceServeSpec) -> list[int]:
    """Indices of the host workers by TPU worker id; they must be the slice's
    hosts, one each, on one slice."""
    topo = spec.parsed
    slices = {r["slice_name"] for r in reports}
    ids = sorted(int(r["worker_id"]) for r in reports if r["worker_id"] is not None)
    if len(slices) != 1 or ids != list(range(topo.num_hosts)):
        raise RuntimeError(
            f"the replica's host workers are not the {topo.num_hosts} hosts of one {topo}: "
            f"slices {sorted(map(str, slices))}, TPU worker ids {ids}"
        )
    return sorted(range(len(reports)), key=lambda i: int(reports[i]["worker_id"]))


def host_envs(spec: SliceServeSpec, hosts: list[str], xprof_session_id: str) -> list[dict]:
    """The env of each host worker (TPU worker id order): `launch_env` of the
    host's first device, less what Ray sets for the chips the worker holds."""
    topo = spec.parsed
    envs = launch_envs(topo, hosts, xprof_session_id=xprof_session_id)
    return [
        {k: v for k, v in envs[w * topo.devices_per_host][1].items() if k not in _KEEP_RAY_KEYS}
        for w in range(topo.num_hosts)
    ]


def _error(message: str, code: int = 400, type_: str = "BadRequestError") -> "R.ErrorResponse":
    return R.ErrorResponse(error=R.ErrorInfo(message=message, type=type_, code=code))


class TorchTPUEngine(R.LLMEngine):
    """Ray Serve LLM engine on one whole TPU slice per replica (see module doc)."""

    def __init__(self, llm_config: "R.LLMConfig"):
        self.llm_config = llm_config
        self.spec = SliceServeSpec.from_llm_config(llm_config)  # fails before anything starts
        source = llm_config.model_loading_config.model_source
        if source is not None and not isinstance(source, str):
            raise ValueError(
                f"model_loading_config.model_source {source!r} is not supported by the TorchTPU "
                "engine; give a Hugging Face id, a local directory or a .gguf file"
            )
        self.model_source = source or llm_config.model_id
        self.dtype = llm_config.engine_kwargs.get("dtype") or "float32"
        self.workers: list = []
        self.placement: list[dict] = []  # per host, TPU worker id order
        self._engine_config = None
        self._lead = None

    # Start-up ------------------------------------------------------------
    async def start(self):
        self._engine_config = self.llm_config.get_engine_config()
        pg = await asyncio.to_thread(self._reserve_slice)
        await pg.ready()
        topo = self.spec.parsed
        actor = ray.remote(HostWorker)
        env_vars = dict(R.SERVE_ENV)
        tag = f"{HOST_WORKER_PREFIX}{self.llm_config.model_id}:{uuid.uuid4().hex[:8]}"
        self.workers = [
            actor.options(
                name=f"{tag}:bundle{i}",
                namespace=HOST_WORKER_NAMESPACE,
                num_cpus=1,
                resources={"TPU": topo.devices_per_host},
                # Threads, so that health pings answer while a request generates
                # (generation itself is serialized by the worker's lock).
                max_concurrency=HOST_WORKER_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": env_vars},
            ).remote()
            for i in range(topo.num_hosts)
        ]
        reports = await asyncio.gather(*[w.report.remote() for w in self.workers])
        order = host_order(reports, self.spec)
        self.workers = [self.workers[i] for i in order]
        reports = [reports[i] for i in order]
        modes = {r["simulate"] for r in reports}
        if len(modes) != 1:
            raise RuntimeError(f"{C.RAY_TRAIN_TPU_SIMULATE}=1 is set on some hosts of the slice but not all")
        mode = "simulate" if modes == {True} else "tpu"
        envs = host_envs(self.spec, [r["node_ip"] for r in reports], str(time.time_ns()))
        await asyncio.gather(*[w.setup.remote(env, mode) for w, env in zip(self.workers, envs)])
        self.placement = [
            {"worker_id": int(r["worker_id"]), "node_ip": r["node_ip"], "slice_name": r["slice_name"],
             "tpu_ids": r["tpu_ids"], "env": env}
            for r, env in zip(reports, envs)
        ]
        self._lead = self.workers[0]
        info = await self._lead.load.remote(self.model_source, self.dtype)
        logger.info(
            "ray_train_tpu: %s on %s (%s), lead host %s, device %s%s", self.llm_config.model_id,
            self.spec.parsed, reports[0]["slice_name"], reports[0]["node_ip"], info["device"],
            " (SIMULATED on CPU)" if mode == "simulate" else "",
        )

    def _reserve_slice(self):
        """Ray's slice placement group for this replica (``TPUAccelerator``),
        retried until a whole slice is free: a replica never takes part of one.
        Each attempt waits up to Ray's head reservation timeout (100 s)."""
        while True:
            try:
                return self._engine_config.get_or_create_pg()
            except (TimeoutError, RuntimeError) as e:
                if "reserve TPU" not in str(e):
                    raise
                logger.info("ray_train_tpu: waiting for a free %s: %s", self.spec.parsed, str(e)[:200])

    # Requests ------------------------------------------------------------
    def _check(self, request: Any, kind: str) -> Optional["R.ErrorResponse"]:
        if getattr(request, "n", 1) not in (None, 1):
            return _error(f"n={request.n} is not supported; rule: n == 1")
        for field in ("stop", "logprobs", "tools"):  # refused, never silently ignored
            if getattr(request, field, None):
                return _error(f"{field} is not supported by the TorchTPU engine; remove it")
        if kind == "chat":
            if not request.messages:
                return _error("messages must be a non-empty list of chat messages")
        elif not isinstance(request.prompt, str) or not request.prompt:
            return _error("prompt must be a non-empty string (token-id and list prompts are not supported)")
        max_tokens = _max_tokens(request)
        if max_tokens is not None and max_tokens < 1:
            return _error(f"max_tokens must be at least 1, got {max_tokens}")
        return None

    async def _stream(self, request: Any, kind: str) -> AsyncGenerator[dict, None]:
        prompt = [dict(m) for m in request.messages] if kind == "chat" else request.prompt
        max_tokens = _max_tokens(request) or 256
        gen = self._lead.generate.options(num_returns="streaming").remote(
            kind, prompt, max_tokens, request.temperature, request.top_p, request.seed
        )
        async for ref in gen:
            yield await ref

    async def chat(self, request, raw_request_info=None):
        error = self._check(request, "chat")
        if error is not None:
            yield error
            return
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.llm_config.model_id
        try:
            if request.stream:
                first = True
                async for item in self._stream(request, "chat"):
                    delta, finish = ({"content": item["text"]}, None) if "text" in item else ({}, item["finish_reason"])
                    if first:
                        delta["role"] = "assistant"
                        first = False
                    chunk = R.ChatCompletionStreamResponse.model_validate({
                        "id": rid, "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    })
                    yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
                return
            text, end = await self._collect(request, "chat")
            yield R.ChatCompletionResponse.model_validate({
                "id": rid, "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": end["finish_reason"]}],
                "usage": _usage(end),
            })
        except ValueError as e:  # e.g. non-text content
            yield _error(str(e))

    async def completions(self, request, raw_request_info=None):
        error = self._check(request, "completion")
        if error is not None:
            yield error
            return
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.llm_config.model_id
        if request.stream:
            async for item in self._stream(request, "completion"):
                chunk = R.CompletionStreamResponse.model_validate({
                    "id": rid, "created": created, "model": model,
                    "choices": [{"index": 0, "text": item.get("text", ""),
                                 "finish_reason": item.get("finish_reason")}],
                })
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
            return
        text, end = await self._collect(request, "completion")
        yield R.CompletionResponse.model_validate({
            "id": rid, "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": end["finish_reason"]}],
            "usage": _usage(end),
        })

    async def _collect(self, request, kind: str) -> tuple[str, dict]:
        pieces, end = [], {}
        async for item in self._stream(request, kind):
            if "text" in item:
                pieces.append(item["text"])
            else:
                end = item
        return "".join(pieces), end

    async def embeddings(self, request, raw_request_info=None):
        yield _error("embeddings are not supported by the TorchTPU engine", 400)

    async def transcriptions(self, request, raw_request_info=None):
        yield _error("transcriptions are not supported by the TorchTPU engine", 400)

    async def resolve_lora(self, lora_model):
        raise NotImplementedError("LoRA is not supported by the TorchTPU engine")

    def routing_stats(self) -> dict:
        return {}

    async def reset_prefix_cache(self) -> None:
        return None  # no prefix cache

    async def check_health(self) -> None:
        """Every host worker answers; a lost host makes Serve replace the replica."""
        await asyncio.wait_for(
            asyncio.gather(*[w.ping.remote() for w in self.workers]), timeout=HEALTH_PING_TIMEOUT_S
        )

    async def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._engine_config is not None:
            self._engine_config.accelerator.shutdown()  # slice + head placement groups


def _max_tokens(request) -> Optional[int]:
    value = getattr(request, "max_completion_tokens", None)
    return request.max_tokens if value is None else value


def _usage(end: dict) -> dict:
    return {
        "prompt_tokens": end["prompt_tokens"],
        "completion_tokens": end["completion_tokens"],
        "total_tokens": end["prompt_tokens"] + end["completion_tokens"],
    }


class TorchTPULLMServer(R.LLMServer):
    """Ray Serve LLM's ``LLMServer`` with the TorchTPU engine; set it as
    ``LLMConfig.server_cls`` (`build_llm_config` does)."""

    _default_engine_cls = TorchTPUEngine

    @classmethod
    def get_deployment_options(cls, llm_config):
        SliceServeSpec.from_llm_config(llm_config)  # before the deployment exists
        return super().get_deployment_options(llm_config)
