"""Reserve one whole TPU slice as a placement group of one bundle per chip.

Ray's `SlicePlacementGroup` gang-schedules a multi-host slice through the slice's
head resource and pins every bundle to that slice's name label. A single-host
slice has no such label, so its bundles are packed onto one host
(``STRICT_PACK``) instead. The trainer and the rollout engine each reserve a
slice; the second reservation cannot land on the first's chips.
"""

from __future__ import annotations

import dataclasses

from ray_train_tpu.topology import Topology


@dataclasses.dataclass
class SliceReservation:
    """A reserved slice: ``placement_group`` with one ``{"TPU": 1, "CPU": 1}``
    bundle per chip, ``node_ips[i]`` the host of bundle ``i``."""

    topology: Topology
    handle: object  # ray.util.tpu.SlicePlacementGroup
    placement_group: object
    node_ips: list[str]

    def shutdown(self) -> None:
        self.handle.shutdown()


def reserve_slice(topology: Topology, *, name: str = "", timeout_s: float = 120.0) -> SliceReservation:
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.tpu import SlicePlacementGroup

    handle = SlicePlacementGroup(
        topology=topology.name,
        accelerator_version=topology.accelerator_type,
        resources_per_bundle={"TPU": 1, "CPU": 1},
        strategy="STRICT_PACK" if topology.num_hosts == 1 else "SPREAD",
        name=name,
    )
    pg = handle.placement_group
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        handle.shutdown()
        raise RuntimeError(f"no free {topology} slice within {timeout_s:.0f} s for {name or 'a placement group'}; "
                           "every slice of the cluster is in use") from None
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    table = placement_group_table(pg)["bundles_to_node_id"]
    return SliceReservation(topology, handle, pg, [nodes[table[i]] for i in range(len(table))])
