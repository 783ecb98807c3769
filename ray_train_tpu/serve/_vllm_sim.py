"""The simulated TPU platform for vLLM: its CPU platform on TPU bundles.

Active only with ``RAY_TRAIN_TPU_SIMULATE=1`` (see `platforms`). vLLM's CPU
platform has no Ray device key, so its Ray executor refuses to run; this
subclass asks Ray for ``{"TPU": 1}`` per worker, like vllm-torchtpu's platform
(``ray_device_key = "TPU"``, ``vllm_torchtpu/platforms/tpu_platform.py``), and
runs each worker as `SliceCPUWorker`, which takes its TorchTPU environment
from `launch_env` and checks that it runs on its rank's host and chip.
Tensors stay on CPU and collectives use gloo: a simulation, said as much.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

from ray_train_tpu import constants as C
from ray_train_tpu.serve import platforms as P

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
SLICE_WORKER = "ray_train_tpu.serve._vllm_sim_worker.SliceCPUWorker"


class SimulatedTPUPlatform(CpuPlatform):
    """vLLM's CPU platform, scheduled on TPU bundles (simulation only)."""

    ray_device_key: str = "TPU"
    # What vLLM's Ray executor copies from the engine to its workers, beyond
    # VLLM_* and HF_*: the slice plan and the simulation's own switches.
    additional_env_vars: list[str] = [
        P.SLICE_PLAN_ENV,
        C.RAY_TRAIN_TPU_SIMULATE,
        C.TPU_SKIP_MDS_QUERY,
        C.TORCH_DEVICE_BACKEND_AUTOLOAD,
        "GLOO_SOCKET_IFNAME",
    ]

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == CPU_WORKER:
            parallel.worker_cls = SLICE_WORKER
