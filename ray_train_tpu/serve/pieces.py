"""Reserve one engine's piece of a slice (see `subslice`): the placement group
of a Serve replica on a sub-slice (`_subslice.SubsliceLLMServer`) and of a
batch engine on one (`batch.reserve_engine`). No vLLM imports here.

1. Whole hosts: Ray's ``SubslicePlacementGroup`` picks them
   (`rl.slices.reserve_subslice`, the RL trainer half's code path, one bundle
   per host); those hosts are then held as one ``{"TPU": 1}`` bundle per chip,
   pinned to them by their Ray labels (vLLM's Ray executor wants one device
   per bundle), and Ray's per-host group is given back.
   Part of one host: the host with the fewest free chips that has room
   (`subslice.pick_host`), its chips as ``{"TPU": 1}`` bundles pinned to it.
2. No free piece: wait and try again (logged every 30 s); another engine that
   took the same host first makes ours try again.
"""

from __future__ import annotations

import logging
import time

from ray_train_tpu import constants as C
from ray_train_tpu._compat.ray_tpu import available_tpus_per_node
from ray_train_tpu.serve.subslice import SubsliceServeSpec, host_rooms, pick_host

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0
# How long a pinned group may stay pending before the replica looks again (another
# replica took the chips between our look and our group).
PINNED_WAIT_S = 10.0
RETRY_S = 1.0


def _pinned_group(selectors: list, name: str):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"TPU": 1} for _ in selectors], strategy="PACK", name=name, bundle_label_selector=selectors)
    if ray.wait([pg.ready()], timeout=PINNED_WAIT_S)[0]:
        return pg
    remove_placement_group(pg)
    return None


def _try_part_of_host(spec: SubsliceServeSpec, name: str):
    import ray

    free = {node: {"TPU": tpus} for node, tpus in available_tpus_per_node().items()}
    rooms = host_rooms(ray.nodes(), free, slice_name_key=C.LABEL_TPU_SLICE_NAME,
                       worker_id_key=C.LABEL_TPU_WORKER_ID, accelerator_key=C.LABEL_ACCELERATOR_TYPE)
    host = pick_host(rooms, spec.engine.num_devices, spec.accelerator_type)
    if host is None:
        return None
    label = {C.LABEL_TPU_SLICE_NAME: host.slice_name, C.LABEL_TPU_WORKER_ID: str(host.worker_id)}
    return _pinned_group([dict(label) for _ in range(spec.engine.num_devices)], name)


def _try_whole_hosts(spec: SubsliceServeSpec, name: str, simulated: bool):
    import ray

    from ray_train_tpu.rl.slices import reserve_subslice

    engine = spec.engine
    try:
        sub = reserve_subslice(engine, resources_per_bundle={"TPU": engine.devices_per_host}, name=name + "-pick",
                               simulated=simulated)
    except RuntimeError as e:  # Ray: no free sub-slice of this shape now
        logger.debug("no free %s sub-slice: %s", engine.name, e)
        return None
    try:
        if not ray.wait([sub.placement_group.ready()], timeout=PINNED_WAIT_S)[0]:
            return None
        selectors = [dict(sel) for sel in sub.bundle_label_selector for _ in range(engine.devices_per_host)]
    finally:
        sub.shutdown()
    return _pinned_group(selectors, name)


def reserve_engine_slice(spec: SubsliceServeSpec, *, name: str, simulated: bool, timeout_s: float | None = None):
    """A placement group of one ``{"TPU": 1}`` bundle per device of a free
    `spec.engine_shape` piece; waits until one is free (see the module doc), at
    most `timeout_s` seconds (None: no limit), then raises TimeoutError."""
    t0, logged = time.monotonic(), -1
    while True:
        if spec.part_of_host:
            pg = _try_part_of_host(spec, name)
        else:
            pg = _try_whole_hosts(spec, name, simulated)
        if pg is not None:
            return pg
        if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
            raise TimeoutError(f"no free {spec.engine_shape} piece of a {spec.accelerator_type} {spec.topology} "
                               f"slice within {timeout_s} s")
        waited = int(time.monotonic() - t0)
        if waited // WAIT_LOG_EVERY_S > logged:
            logged = waited // WAIT_LOG_EVERY_S
            logger.info("engine waits for a free %s %s piece of a %s slice (%d s)", spec.accelerator_type,
                        spec.engine_shape, spec.topology, waited)
        time.sleep(RETRY_S)
