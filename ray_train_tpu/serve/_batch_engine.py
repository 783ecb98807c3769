"""`SliceEngineUDF`: Ray Data LLM's vLLM engine actor for `batch`, on what
`batch.reserve_engine` reserved for it, naming its slice on every row it
returns.

- An engine of several devices is laid out on its placement group first
  (`_layout.lay_out`, as a Serve replica is; a sub-slice plan for an
  ``engine_shape`` piece), then vLLM's Ray executor starts one worker per chip.
- An engine of one device holds its chip in this actor (`worker_check.check_chip_engine`,
  as an RL rollout engine does): vLLM's worker runs in the engine core, which
  inherits the chip's variables that Ray set for this actor.
"""

from __future__ import annotations

import logging
import sys

from ray_train_tpu import constants as C
from ray_train_tpu._compat import vllm as V

V.log_to_stderr()  # before this actor imports vLLM (the stage, below), as serving's replicas do

from ray_train_tpu._compat.ray_data import vLLMEngineStageUDF  # noqa: E402
from ray_train_tpu.serve._layout import lay_out  # noqa: E402
from ray_train_tpu.topology import Topology  # noqa: E402

logger = logging.getLogger(__name__)


def _log_to_stderr() -> None:
    """This actor runs our engine class: our INFO lines go to its stderr (kept in
    the worker's log, shown on the driver), as vLLM's do. Nothing else in the
    process configures logging here, unless something did already."""
    package = logging.getLogger(__name__.split(".")[0])
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    package.addHandler(handler)
    package.setLevel(logging.INFO)


class SliceEngineUDF(vLLMEngineStageUDF):
    """Ray Data LLM's vLLM engine on the actor's slice (or piece of one)."""

    def __init__(self, *args, slice_topology: str, slice_accelerator_type: str, slice_column: str,
                 sub_slice: bool = False, chip_in_actor: bool = False, **kwargs):
        import ray

        _log_to_stderr()
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("a batch engine must run in its reservation's placement group (reserve_engine)")
        if chip_in_actor:
            from ray_train_tpu.serve.worker_check import check_chip_engine

            labels = dict(ray.get_runtime_context().get_node_labels() or {})
            self.slice_name = labels.get(C.LABEL_TPU_SLICE_NAME)
            chip = check_chip_engine(slice_name=self.slice_name)
            logger.info("one-chip engine on slice %s, chip %d", self.slice_name, chip)
        else:
            plan = lay_out(pg, Topology.parse(slice_topology, slice_accelerator_type), sub_slice=sub_slice)
            self.slice_name = plan.slice_name
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
            row[self.slice_column] = self.slice_name
            yield row
