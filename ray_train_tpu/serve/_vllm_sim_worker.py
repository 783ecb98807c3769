"""`SliceCPUWorker`: vLLM's CPU worker as one device of a simulated slice."""

from __future__ import annotations

import logging

from vllm.v1.worker.cpu_worker import CPUWorker

from ray_train_tpu import _environ
from ray_train_tpu.launch_env import JOB_KEYS, reconcile
from ray_train_tpu import constants as C
from ray_train_tpu.serve import platforms as P
from ray_train_tpu.serve.slice_plan import SlicePlan, check_worker_place

logger = logging.getLogger(__name__)


class SliceCPUWorker(CPUWorker):
    """Before the device starts: check that this rank runs on the host and chip
    the replica's slice plan gives it, then set the TorchTPU environment that
    `launch_env` computes for it (the training code path). Without a plan
    (vLLM run outside a replica, e.g. offline on one host) it is vLLM's CPU
    worker."""

    slice_env_applied: dict = {}

    def init_device(self):
        text = _environ.get(P.SLICE_PLAN_ENV)
        if text:
            import ray

            plan = SlicePlan.from_json(text)
            chips = ray.get_runtime_context().get_accelerator_ids().get("TPU", [])
            check_worker_place(plan, self.rank, worker_id=_environ.get(C.TPU_WORKER_ID),
                               slice_name=_environ.get(C.TPU_NAME), chips=chips)
            env = plan.worker_env(self.rank)
            # As in training (launch_env.reconcile): job variables the host carries
            # that this replica does not set (a gone job's MEGASCALE_*) are removed.
            stale = reconcile(env, _environ.snapshot(JOB_KEYS), {}).unset
            _environ.unset(stale)
            _environ.update(env)
            self.slice_env_applied = env
            logger.info("SIMULATED TPU worker rank %d on %s: %s", self.rank, plan.slice_name, env)
        super().init_device()

    def slice_env(self) -> dict:
        """What this worker is and was given (``LLMServer.collective_rpc("slice_env")``)."""
        import ray

        return {"rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "env": dict(self.slice_env_applied)}
