"""`SliceEngineUDF`: Ray Data LLM's vLLM engine actor for `batch`, laid out on
the slice it runs in first (`_layout.lay_out`, as a Serve replica is; the slice
was reserved by `batch.reserve_slice`), naming that slice on every row it
returns."""

from __future__ import annotations

import logging

from ray_train_tpu._compat import vllm as V
from ray_train_tpu._compat.ray_llm import vLLMEngineStageUDF
from ray_train_tpu.serve._layout import lay_out
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)


class SliceEngineUDF(vLLMEngineStageUDF):
    """Ray Data LLM's vLLM engine on the actor's slice."""

    def __init__(self, *args, slice_topology: str, slice_accelerator_type: str, slice_column: str, **kwargs):
        import ray

        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("a batch engine must run in its slice's placement group (reserve_slice)")
        self.slice_plan = lay_out(pg, Topology.parse(slice_topology, slice_accelerator_type))
        self.slice_column = slice_column
        super().__init__(*args, **kwargs)

    def __del__(self):
        # Ray Data shuts the engine down here once the rows are done: its output
        # handler goes first, so that the shutdown logs no EngineDeadError
        # (`_compat.vllm.cancel_output_handler`).
        V.cancel_output_handler(getattr(getattr(self, "llm", None), "engine", None))
        super().__del__()

    async def udf(self, batch):
        async for row in super().udf(batch):
            row[self.slice_column] = self.slice_plan.slice_name
            yield row
