"""Ray Serve LLM callback that lays a replica's vLLM workers out on its slice.

Runs in the replica, before its vLLM engine starts (``on_before_node_init``),
once Ray Serve LLM has asked for the replica's slice placement group; see
`ray_train_tpu.serve._layout` for what it does.
"""

from __future__ import annotations

import asyncio
import os

from ray_train_tpu._compat.ray_llm import CallbackBase
from ray_train_tpu.serve._layout import lay_out
from ray_train_tpu.serve.slice_plan import engine_topology
from ray_train_tpu.topology import Topology


class SliceLayoutCallback(CallbackBase):
    """See the module doc. ``callback_kwargs``: ``topology``, ``accelerator_type``
    and, for a replica on a sub-slice of such a slice, ``engine_shape``."""

    async def on_before_node_init(self) -> None:
        shape = self.kwargs.get("engine_shape")
        if shape:
            topo = engine_topology(shape, self.kwargs["accelerator_type"])
        else:
            topo = Topology.parse(self.kwargs["topology"], self.kwargs["accelerator_type"])
        # In a thread: waiting for a slice must not block the replica's event loop.
        await asyncio.to_thread(lay_out, self.ctx.placement_group, topo, sub_slice=bool(shape))
        # A local model directory needs no download on the hosts.
        if os.path.isdir(self.llm_config.model_loading_config.model_source or ""):
            self.ctx.run_init_node = False
