"""Every touch of vllm-torchtpu internals, pinned to `constants.VLLM_TORCHTPU_VERSION`.

vllm-torchtpu's Ray executor (``RayDistributedExecutorV2`` in
``vllm_torchtpu/executors/ray_distributed_executor_v2.py``) places rank r in
bundle ``VLLM_RAY_BUNDLE_INDICES[r]``, then builds the slice's host list
(``_slice_host_layout(device_str) -> (hosts, {host: devices})``: slice-builder
addresses ``ip:TORCH_TPU_BASE_PORT+chip``, ``NODE_RANK``, ``MASTER_ADDR``) from
every TPU node in ``ray.nodes()``: with two slices in one cluster, two engines
would mix each other's hosts. `confine_executor` makes that method answer from
the engine's own slice when there is one. It starts every worker in vLLM's
``RayWorkerProc`` (see `ray_train_tpu._compat.vllm.use_worker_proc`).
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

from ray_train_tpu import constants as C

TESTED_VLLM_TORCHTPU_VERSION = C.VLLM_TORCHTPU_VERSION

DIST = "vllm-torchtpu"
CORE_DIST = "vllm-torchtpu-core"
EXECUTOR_MODULE = "vllm_torchtpu.executors.ray_distributed_executor_v2"
EXECUTOR_CLASS = "RayDistributedExecutorV2"
LAYOUT_METHOD = "_slice_host_layout"
# vllm_torchtpu/platforms/tpu_platform.py: these select the executor above.
EXECUTOR_ENV = {"TPU_MULTIHOST_BACKEND": "ray", "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}

HostLayout = tuple[list, dict]


def executor_class() -> type:
    from importlib import metadata

    from ray_train_tpu._compat.vllm import warn_if_untested

    warn_if_untested(DIST, metadata.version(CORE_DIST), TESTED_VLLM_TORCHTPU_VERSION)
    return getattr(importlib.import_module(EXECUTOR_MODULE), EXECUTOR_CLASS)


def confine_executor(executor_cls: type, layout: Callable[[], Optional[HostLayout]]) -> None:
    """Make ``executor_cls._slice_host_layout`` return `layout()` (the engine's
    own slice: hosts in TPU worker id order, devices per host) unless that is
    None. Idempotent."""
    original = getattr(executor_cls, LAYOUT_METHOD)
    original = getattr(original, "_ray_train_tpu_original", original)

    def _slice_host_layout(self, device_str):
        ours = layout()
        return original(self, device_str) if ours is None else ours

    _slice_host_layout._ray_train_tpu_original = original
    setattr(executor_cls, LAYOUT_METHOD, _slice_host_layout)
