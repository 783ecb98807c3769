"""What runs in and around Ray Data LLM's engine actors for `batch`: one whole
TPU slice per engine.

`reserve_slice` is the stage's ``ray_remote_args_fn``: Ray Data calls it in the
driver for every engine actor it starts, and the actor runs in the placement
group it returns (Ray's ``SlicePlacementGroup``: one ``{"TPU": 1}`` bundle per
device, gang-scheduled on one slice; child tasks captured, so that vLLM's Ray
executor finds it). Reservations are recorded per batch job and released with
it (`release`). `SliceEngineUDF` is Ray Data LLM's engine, laid out on its slice
first (`_layout.lay_out`, as a Serve replica is), and names the slice on every
row it returns.
"""

from __future__ import annotations

import logging
import threading

from ray_train_tpu._compat.ray_llm import vLLMEngineStageUDF
from ray_train_tpu.serve._layout import lay_out
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)

SLICE_COLUMN = "slice"

# batch job id -> its SlicePlacementGroup handles (in the driver).
_RESERVATIONS: dict[str, list] = {}
_LOCK = threading.Lock()


def reserve_slice(job: str, topology: str, accelerator_type: str, strategy: str) -> dict:
    """Reserve one whole free slice for an engine actor (blocks until its head
    is reserved); returns the actor's scheduling strategy."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from ray.util.tpu import SlicePlacementGroup

    with _LOCK:
        handles = _RESERVATIONS.setdefault(job, [])
        handle = SlicePlacementGroup(topology=topology, accelerator_version=accelerator_type,
                                     resources_per_bundle={"TPU": 1}, strategy=strategy,
                                     name=f"{job}-engine-{len(handles)}")
        handles.append(handle)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        handle.placement_group, placement_group_capture_child_tasks=True)}


def reservations(job: str) -> int:
    with _LOCK:
        return len(_RESERVATIONS.get(job, []))


def release(job: str) -> int:
    """Release every slice reserved for `job` (its engines die with them)."""
    with _LOCK:
        handles = _RESERVATIONS.pop(job, [])
    for handle in handles:
        handle.shutdown()
    return len(handles)


class SliceEngineUDF(vLLMEngineStageUDF):
    """Ray Data LLM's vLLM engine on the actor's slice."""

    def __init__(self, *args, slice_topology: str, slice_accelerator_type: str, **kwargs):
        import ray

        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("a batch engine must run in its slice's placement group (reserve_slice)")
        self.slice_plan = lay_out(pg, Topology.parse(slice_topology, slice_accelerator_type))
        super().__init__(*args, **kwargs)

    async def udf(self, batch):
        async for row in super().udf(batch):
            row[SLICE_COLUMN] = self.slice_plan.slice_name
            yield row
