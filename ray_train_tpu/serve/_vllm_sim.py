"""The simulated TPU platform for vLLM: its CPU platform on TPU bundles.

Active only with ``RAY_TRAIN_TPU_SIMULATE=1`` (see `platforms`). vLLM's CPU
platform has no Ray device key, so its Ray executor refuses to run; this
subclass asks Ray for ``{"TPU": 1}`` per worker, like vllm-torchtpu's platform
(``ray_device_key = "TPU"``, ``vllm_torchtpu/platforms/tpu_platform.py``), and
runs each worker as `SliceCPUWorker`. Every worker's TorchTPU environment and
place are checked and set before it starts, as on TPUs
(`ray_train_tpu.serve._worker_proc`). Tensors stay on CPU and collectives use
gloo: a simulation, said as much.
"""

from __future__ import annotations

from ray_train_tpu import constants as C
from ray_train_tpu._compat import vllm as V
from ray_train_tpu._compat.vllm import CpuPlatform
from ray_train_tpu.serve import platforms as P

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
        V.replace_worker_cls(vllm_config, V.CPU_WORKER, SLICE_WORKER)
