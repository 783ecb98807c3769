"""`SliceCPUWorker`: vLLM's CPU worker as one device of a simulated slice.

Its environment and place were checked, and its TorchTPU environment set from
`launch_env`, before it started (`ray_train_tpu.serve.worker_check`); this
class only reports them (``LLMServer.collective_rpc("slice_env")``).
"""

from __future__ import annotations

from ray_train_tpu._compat.vllm import CPUWorker
from ray_train_tpu.serve import worker_check


class SliceCPUWorker(CPUWorker):
    """vLLM's CPU worker, able to say what it is."""

    def slice_env(self) -> dict:
        """This worker's rank, host address and TorchTPU environment."""
        import ray

        return {"rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "env": dict(worker_check.APPLIED)}
