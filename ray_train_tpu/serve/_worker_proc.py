"""`SliceWorkerProc`: the Ray actor every vLLM worker of a slice starts in.

vLLM's Ray executor (V2) and vllm-torchtpu's both start each worker in vLLM's
``RayWorkerProc`` and hand it its environment in ``initialize_worker``, before
the worker's device starts; our vLLM plugin makes them start this subclass
(`ray_train_tpu._compat.vllm.use_worker_proc`). When the engine runs on a slice
plan (``RAY_TRAIN_TPU_SERVE_SLICE``, set where the engine starts), every worker
runs `worker_check.slice_worker_setup` first, in simulation and on TPUs alike.
Without a plan (vLLM outside a slice) it is vLLM's ``RayWorkerProc``.
"""

from __future__ import annotations

from ray_train_tpu import _environ
from ray_train_tpu._compat import vllm as V
from ray_train_tpu.serve.worker_check import slice_worker_setup


class SliceWorkerProc(V.RayWorkerProc):
    """See the module doc."""

    def initialize_worker(self, local_rank, env_vars, distributed_init_method, driver_env_vars=None,
                          assigned_physical_gpu_ids=None):
        # As vLLM applies them: the engine's variables fill gaps, the executor's win.
        engine_env = {**(driver_env_vars or {}), **_environ.copy(), **(env_vars or {})}
        extra = slice_worker_setup(V.worker_proc_rank(self), local_rank, engine_env)
        return super().initialize_worker(local_rank, {**(env_vars or {}), **extra}, distributed_init_method,
                                         driver_env_vars, assigned_physical_gpu_ids)
