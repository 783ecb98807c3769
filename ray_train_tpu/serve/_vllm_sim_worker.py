"""`SliceCPUWorker`: vLLM's CPU worker as one device of a simulated slice.

Its environment and place were checked, and its TorchTPU environment set from
`launch_env`, before it started (`ray_train_tpu.serve.worker_check`); this
class only reports them (``LLMServer.collective_rpc("slice_env")``). It has
vllm-torchtpu's ``TPUWorker``'s methods, not more: the GPU worker's own (its
weight-transfer API, sleep mode, ...) are hidden
(`ray_train_tpu.serve._torchtpu_rules.gpu_only_methods`), so that calling one
fails here as on TPUs.
"""

from __future__ import annotations

from ray_train_tpu._compat.vllm import CPUWorker, WorkerBase
from ray_train_tpu.serve import _torchtpu_rules as R
from ray_train_tpu.serve import worker_check


class SliceCPUWorker(CPUWorker):
    """vLLM's CPU worker, able to say what it is, with TPUWorker's methods."""

    def slice_env(self) -> dict:
        """This worker's rank, host address and TorchTPU environment."""
        import ray

        return {"rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "env": dict(worker_check.APPLIED)}


R.hide_methods(SliceCPUWorker, R.gpu_only_methods(CPUWorker, WorkerBase))
