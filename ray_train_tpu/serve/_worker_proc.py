"""`SliceWorkerProc`: the Ray actor every vLLM worker of a slice starts in.

vLLM's Ray executor (V2) and vllm-torchtpu's both start each worker in vLLM's
``RayWorkerProc`` and hand it its environment in ``initialize_worker``, before
the worker's device starts; our vLLM plugin makes them start this subclass
(`ray_train_tpu._compat.vllm.use_worker_proc`). When the engine runs on a slice
plan (``RAY_TRAIN_TPU_SERVE_SLICE``, set by the replica callback or the batch
engine), every worker runs `slice_plan.slice_worker_env` first, in simulation
and on TPUs alike: it must run on its rank's host and chip, and on a TPU the
environment vllm-torchtpu computed must be `launch_env`'s. In simulation the
worker gets `launch_env`'s environment (vLLM's CPU platform sets none).
Without a plan (vLLM outside a slice) it is vLLM's ``RayWorkerProc``.
"""

from __future__ import annotations

import logging

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._compat import vllm as V
from ray_train_tpu.serve.slice_plan import SlicePlan, slice_worker_env

logger = logging.getLogger(__name__)

# What this process's worker was given (one worker per process), for `SliceCPUWorker.slice_env`.
APPLIED: dict = {}


class SliceWorkerProc(V.RayWorkerProc):
    """See the module doc."""

    def initialize_worker(self, local_rank, env_vars, distributed_init_method, driver_env_vars=None,
                          assigned_physical_gpu_ids=None):
        # The executor's own variables reach the process in this call: the
        # engine's (driver_env_vars) only fill gaps, as vLLM applies them.
        engine_env = {**(driver_env_vars or {}), **_environ.copy(), **(env_vars or {})}
        text = engine_env.get(C.RAY_TRAIN_TPU_SERVE_SLICE)
        if text:
            env_vars = {**(env_vars or {}), **self._slice_env(SlicePlan.from_json(text), local_rank, engine_env)}
        return super().initialize_worker(local_rank, env_vars, distributed_init_method, driver_env_vars,
                                         assigned_physical_gpu_ids)

    def _slice_env(self, plan: SlicePlan, local_rank: int, engine_env: dict) -> dict:
        import ray

        rank = V.worker_proc_rank(self)
        simulated = _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"
        chips = ray.get_runtime_context().get_accelerator_ids().get("TPU", [])
        env = slice_worker_env(plan, rank, local_rank=local_rank, chips=chips, host_env=_environ.copy(),
                               engine_env=engine_env, simulated=simulated)
        _environ.unset(env.unset)
        APPLIED.clear()
        APPLIED.update(env.set)
        note = "SIMULATED TPU" if simulated else "TPU"
        logger.info("%s worker rank %d on %s (host %s, chip %s): environment checked%s", note, rank,
                    plan.slice_name, plan.hosts[plan.place(rank)[0]], plan.place(rank)[1],
                    f", given {sorted(env.set)}" if env.set else "")
        return env.set
