"""A serving replica that reserves its own sub-slice (see `subslice`), in the
replica's process, before its vLLM engine starts.

1. Whole hosts: Ray's ``SubslicePlacementGroup`` picks them
   (`rl.slices.reserve_subslice`, the RL trainer half's code path, one bundle
   per host); those hosts are then held as one ``{"TPU": 1}`` bundle per chip,
   pinned to them by their Ray labels (vLLM's Ray executor wants one device
   per bundle), and Ray's per-host group is given back.
   Part of one host: the host with the fewest free chips that has room
   (`subslice.pick_host`), its chips as ``{"TPU": 1}`` bundles pinned to it.
2. No free piece: wait and try again (logged every 30 s); another replica that
   took the same host first makes ours try again.
3. The group is handed to Ray Serve LLM (`_compat.ray_llm.use_placement_group`);
   our callback lays the engine's workers out on it (`_layout.lay_out`, a
   sub-slice plan) as it does on a whole slice. The group fate-shares with the
   replica: a replica that dies or is scaled down releases its piece.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._compat import ray_llm as R
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

    free = {node: {"TPU": tpus} for node, tpus in R.available_tpus_per_node().items()}
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


def reserve_engine_slice(spec: SubsliceServeSpec, *, name: str, simulated: bool):
    """A placement group of one ``{"TPU": 1}`` bundle per device of a free
    `spec.engine_shape` piece; waits until one is free (see the module doc)."""
    t0, logged = time.monotonic(), -1
    while True:
        if spec.part_of_host:
            pg = _try_part_of_host(spec, name)
        else:
            pg = _try_whole_hosts(spec, name, simulated)
        if pg is not None:
            return pg
        waited = int(time.monotonic() - t0)
        if waited // WAIT_LOG_EVERY_S > logged:
            logged = waited // WAIT_LOG_EVERY_S
            logger.info("replica waits for a free %s %s piece of a %s slice (%d s)", spec.accelerator_type,
                        spec.engine_shape, spec.topology, waited)
        time.sleep(RETRY_S)


class SubsliceLLMServer(R.LLMServer):
    """Ray Serve LLM's ``LLMServer`` (``LLMConfig.server_cls``) whose replica
    runs its engine on a sub-slice it reserves itself (see the module doc).
    The sub-slice is the callback's ``engine_shape`` kwarg."""

    async def start(self):
        kwargs = self._llm_config.callback_config.callback_kwargs
        spec = SubsliceServeSpec(accelerator_type=kwargs["accelerator_type"], topology=kwargs["topology"],
                                 engine_shape=kwargs["engine_shape"])
        simulated = _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"
        # In a thread: waiting for a piece must not block the replica's event loop.
        pg = await asyncio.to_thread(reserve_engine_slice, spec, name="", simulated=simulated)

        def release():
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)

        R.use_placement_group(self._llm_config, pg, release)
        await super().start()
