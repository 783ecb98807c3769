"""Ray Serve LLM callback that lays a replica's vLLM workers out on its slice.

Runs in the replica, before its vLLM engine starts (``on_before_node_init``),
once Ray Serve LLM has asked for the replica's slice placement group (one
bundle per device, gang-scheduled on one slice by ``SlicePlacementGroup``):

1. waits until the whole slice is reserved (a replica without a free slice
   waits here; it never takes part of one);
2. asks each bundle which node and chip it holds (a zero-CPU task per
   bundle; Ray fixes a bundle's chip when it reserves it) and reads each
   node's ``ray.io/tpu-slice-name`` / ``ray.io/tpu-worker-id`` labels;
3. orders the bundles by (TPU worker id, chip) (`slice_plan.plan_slice`) and
   hands vLLM's Ray executor ``VLLM_RAY_BUNDLE_INDICES`` in that order, plus
   the plan itself (``RAY_TRAIN_TPU_SERVE_SLICE``), from which every worker
   derives its `launch_env` and, with vllm-torchtpu, the slice's hosts.

vLLM's workers therefore run only in the replica's own bundles: two replicas
on two slices never share a host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu.serve import platforms as P
from ray_train_tpu.serve.slice_plan import BundlePlace, plan_slice
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0


def no_setup() -> None:
    """Worker setup hook of the probes: nothing (the replica's own hook, Ray Serve
    LLM's, imports vLLM, seconds per probe for nothing)."""


def _bundle_chip() -> tuple[str, list[str]]:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(i) for i in ctx.get_accelerator_ids().get("TPU", [])]


class SliceLayoutCallback(CallbackBase):
    """See the module doc. ``callback_kwargs``: ``topology``, ``accelerator_type``."""

    async def on_before_node_init(self) -> None:
        topo = Topology.parse(self.kwargs["topology"], self.kwargs["accelerator_type"])
        pg = self.ctx.placement_group
        t0 = time.monotonic()
        while True:
            ready, _ = ray.wait([pg.ready()], timeout=0)
            if ready:
                break
            waited = time.monotonic() - t0
            if int(waited) % int(WAIT_LOG_EVERY_S) == 0:
                logger.info("replica waits for a free %s %s slice (%.0f s)", topo.accelerator_type, topo, waited)
            await asyncio.sleep(1.0)
        table = ray.util.placement_group_table(pg)
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        probe = ray.remote(_bundle_chip)
        refs = [
            probe.options(
                num_cpus=0, resources={"TPU": 1},
                runtime_env={"worker_process_setup_hook": f"{__name__}.no_setup"},
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(len(table["bundles"]))
        ]
        places = []
        for i, (node_id, chips) in enumerate(await asyncio.gather(*refs)):
            node = nodes.get(node_id, {})
            labels = node.get("Labels") or node.get("labels") or {}
            if len(chips) != 1:
                raise RuntimeError(f"bundle {i} of the replica's placement group holds TPU ids {chips}, not one chip")
            wid = labels.get(C.LABEL_TPU_WORKER_ID)
            places.append(BundlePlace(
                index=i, node_id=node_id, node_ip=node.get("NodeManagerAddress", ""),
                slice_name=labels.get(C.LABEL_TPU_SLICE_NAME),
                worker_id=None if wid is None else int(wid), chip=int(chips[0]),
            ))
        plan = plan_slice(topo, places, xprof_session_id=str(time.time_ns()))
        _environ.update({
            P.VLLM_RAY_BUNDLE_INDICES: ",".join(map(str, plan.bundle_indices)),
            P.SLICE_PLAN_ENV: plan.to_json(),
        })
        logger.info("replica's slice %s: hosts %s, bundles by rank %s", plan.slice_name, plan.hosts, plan.bundle_indices)
        # A local model directory needs no download on the hosts.
        if os.path.isdir(self.llm_config.model_loading_config.model_source or ""):
            self.ctx.run_init_node = False
