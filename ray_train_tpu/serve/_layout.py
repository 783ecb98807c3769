"""Lay an engine's vLLM workers out on its slice: runs in the process that
starts the engine (a Serve replica, a batch engine actor), once its slice
placement group exists (one ``{"TPU": 1}`` bundle per device, gang-scheduled on
one slice by ``SlicePlacementGroup``).

1. wait until the whole slice is reserved (an engine without a free slice
   waits here; it never takes part of one);
2. ask each bundle which node and chip it holds (a zero-CPU task per bundle;
   Ray fixes a bundle's chip when it reserves it) and read each node's
   ``ray.io/tpu-slice-name`` / ``ray.io/tpu-worker-id`` labels;
3. order the bundles by (TPU worker id, chip) (`slice_plan.plan_slice`) and hand
   vLLM's Ray executor ``VLLM_RAY_BUNDLE_INDICES`` in that order, plus the plan
   itself (``RAY_TRAIN_TPU_SERVE_SLICE``), which every worker checks itself
   against before its device starts (`_worker_proc`) and from which vllm-torchtpu
   takes the slice's hosts.

vLLM's workers therefore run only in the engine's own bundles: two engines on
two slices never share a host.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu.serve.slice_plan import BundlePlace, SlicePlan, plan_slice
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0


def no_setup() -> None:
    """Worker setup hook of the probes: nothing (an engine's own hook, such as
    Ray Serve LLM's, imports vLLM: seconds per probe for nothing)."""


def _bundle_chip() -> tuple[str, list[str]]:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(i) for i in ctx.get_accelerator_ids().get("TPU", [])]


def wait_for_slice(pg, topo: Topology) -> None:
    t0, logged = time.monotonic(), -1
    while not ray.wait([pg.ready()], timeout=1.0)[0]:
        waited = int(time.monotonic() - t0)
        if waited // WAIT_LOG_EVERY_S > logged:
            logged = waited // WAIT_LOG_EVERY_S
            logger.info("engine waits for a free %s %s slice (%d s)", topo.accelerator_type, topo, waited)


def lay_out(pg, topo: Topology, *, sub_slice: bool = False) -> SlicePlan:
    """Wait for `pg`, plan its bundles, and set the engine's environment (see
    the module doc). Blocking: from async code, run it in a thread.
    ``sub_slice``: `topo` is the engine's piece of a larger slice
    (`ray_train_tpu.serve.subslice`), whose topology the hosts' labels name."""
    wait_for_slice(pg, topo)
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
    places, parents = [], set()
    for i, (node_id, chips) in enumerate(ray.get(refs)):
        node = nodes.get(node_id, {})
        labels = node.get("Labels") or node.get("labels") or {}
        if len(chips) != 1:
            raise RuntimeError(f"bundle {i} of the engine's placement group holds TPU ids {chips}, not one chip")
        wid = labels.get(C.LABEL_TPU_WORKER_ID)
        parents.add(labels.get(C.LABEL_TPU_TOPOLOGY))
        places.append(BundlePlace(
            index=i, node_id=node_id, node_ip=node.get("NodeManagerAddress", ""),
            slice_name=labels.get(C.LABEL_TPU_SLICE_NAME),
            worker_id=None if wid is None else int(wid), chip=int(chips[0]),
        ))
    parent = None
    if sub_slice:
        if len(parents) != 1 or None in parents:
            raise RuntimeError(f"the engine's {topo.name} sub-slice spans hosts of slice topologies {sorted(map(str, parents))}")
        parent = Topology.parse(parents.pop(), topo.accelerator_type)
    plan = plan_slice(topo, places, xprof_session_id=str(time.time_ns()), parent=parent)
    _environ.update({
        C.VLLM_RAY_BUNDLE_INDICES: ",".join(map(str, plan.bundle_indices)),
        C.RAY_TRAIN_TPU_SERVE_SLICE: plan.to_json(),
    })
    logger.info("engine's slice %s: hosts %s, bundles by rank %s", plan.slice_name, plan.hosts, plan.bundle_indices)
    return plan

