"""A serving replica that reserves its own sub-slice (see `subslice`), in the
replica's process, before its vLLM engine starts.

1. The replica reserves its piece (`pieces.reserve_engine_slice`: whole hosts
   through Ray's ``SubslicePlacementGroup``, or chips of one host), waiting
   until one is free.
2. The group is handed to Ray Serve LLM (`_compat.ray_llm.use_placement_group`);
   our callback lays the engine's workers out on it (`_layout.lay_out`, a
   sub-slice plan) as it does on a whole slice. The group fate-shares with the
   replica: a replica that dies or is scaled down releases its piece.
"""

from __future__ import annotations

import asyncio

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._compat import ray_llm as R
from ray_train_tpu.serve.pieces import reserve_engine_slice
from ray_train_tpu.serve.subslice import SubsliceServeSpec


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
