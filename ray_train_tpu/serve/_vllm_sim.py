"""The simulated TPU platform for vLLM: its CPU platform on TPU bundles, under
vllm-torchtpu's rules.

Active only with ``RAY_TRAIN_TPU_SIMULATE=1`` (see `platforms`). vLLM's CPU
platform has no Ray device key, so its Ray executor refuses to run; this
subclass asks Ray for ``{"TPU": 1}`` per worker, like vllm-torchtpu's platform
(``ray_device_key = "TPU"``, ``vllm_torchtpu/platforms/tpu_platform.py``), and
runs each worker as `SliceCPUWorker`. Every worker's TorchTPU environment and
place are checked and set before it starts, as on TPUs
(`ray_train_tpu.serve._worker_proc`). Tensors stay on CPU and collectives use
gloo: a simulation, said as much.

It follows vllm-torchtpu's rules where vLLM's CPU platform differs
(`ray_train_tpu.serve._torchtpu_rules`, each tested against vllm-torchtpu's own
code): seeded sampling refused, the executor picked from
``TPU_MULTIHOST_BACKEND`` whatever ``distributed_executor_backend`` says,
log-probs of the raw logits whatever ``logprobs_mode`` says, and no GPU-worker
methods on the worker.
"""

from __future__ import annotations

import logging

from ray_train_tpu import constants as C
from ray_train_tpu._compat import vllm as V
from ray_train_tpu._compat.vllm import CpuPlatform
from ray_train_tpu.serve import _torchtpu_rules as R
from ray_train_tpu.serve import platforms as P

logger = logging.getLogger(__name__)

SLICE_WORKER = "ray_train_tpu.serve._vllm_sim_worker.SliceCPUWorker"


class SimulatedTPUPlatform(CpuPlatform):
    """vLLM's CPU platform, scheduled on TPU bundles, under vllm-torchtpu's rules (simulation only)."""

    ray_device_key: str = "TPU"
    # What vLLM's Ray executor copies from the engine to its workers, beyond
    # VLLM_* and HF_*: the slice plan and the simulation's own switches.
    additional_env_vars: list[str] = [
        P.SLICE_PLAN_ENV,
        C.RAY_TRAIN_TPU_SIMULATE,
        C.TPU_SKIP_MDS_QUERY,
        C.TORCH_DEVICE_BACKEND_AUTOLOAD,
        R.MULTIHOST_BACKEND_ENV,
        "GLOO_SOCKET_IFNAME",
    ]

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        chosen = apply_executor_rule(vllm_config.parallel_config)
        super().check_and_update_config(vllm_config)
        # vLLM's CPU platform makes "uni" "mp" when the engine core has a process of
        # its own (OMP set up in a fresh process); vllm-torchtpu keeps "uni" there,
        # the worker in the engine core (no thread binding in simulation).
        vllm_config.parallel_config.distributed_executor_backend = chosen
        V.replace_worker_cls(vllm_config, V.CPU_WORKER, SLICE_WORKER)
        apply_logprobs_rule(vllm_config.model_config)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        R.validate_request(params)


def apply_executor_rule(parallel) -> str:
    """The executor vllm-torchtpu would pick (`_torchtpu_rules.simulated_executor`),
    whatever ``distributed_executor_backend`` said; returns it."""
    chosen = R.simulated_executor(parallel)
    if parallel.distributed_executor_backend not in (None, chosen):
        logger.info("distributed_executor_backend %r ignored: vllm-torchtpu picks its executor from %s "
                    "(simulated: %r)", parallel.distributed_executor_backend, R.MULTIHOST_BACKEND_ENV, chosen)
    parallel.distributed_executor_backend = chosen
    return chosen


def apply_logprobs_rule(model_config) -> None:
    """Log-probs of the raw logits, whatever ``logprobs_mode`` said."""
    if model_config is not None and V.logprobs_mode(model_config) != R.LOGPROBS_MODE:
        logger.info("logprobs_mode %r ignored: vllm-torchtpu reports log-probs of the raw logits (%r)",
                    V.logprobs_mode(model_config), R.LOGPROBS_MODE)
        V.set_logprobs_mode(model_config, R.LOGPROBS_MODE)
