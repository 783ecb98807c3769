"""Where the trainer and the engines run: two slices, or two halves of one.

- Two slices (default): each reserves a whole slice through Ray's
  `SlicePlacementGroup`, one ``{"TPU": 1, "CPU": 1}`` bundle per chip (a
  multi-host slice is gang-scheduled through its head resource and pinned to
  its slice name; a single-host slice is packed onto one host of that
  topology, by its ``ray.io/tpu-topology`` label).
- One slice (``one_slice=True``): the trainer takes half of the slice through
  Ray's `SubslicePlacementGroup` (Ray picks hosts that form a valid,
  ICI-connected sub-slice from the chips' coordinates), and the engines take
  the other hosts, one bundle per chip pinned by the hosts' Ray labels (vLLM's
  Ray executor wants one device per bundle). The trainer's actors see their
  half as a slice of its own (``TPU_TOPOLOGY`` = the half, worker ids from 0).
  A slice that cannot be halved (one host; a half that is not a slice shape)
  is refused by name.

Simulated hosts have no chips to ask for coordinates: Ray's subslice
discovery is given each simulated chip's coordinates instead
(`simulated_chip_coords`), in the axis order Ray 2.60 reads them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from ray_train_tpu import constants as C
from ray_train_tpu.topology import Topology, valid_topologies

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevicePlace:
    """One device of a reservation: its bundle, host and chip."""

    bundle: int
    node_id: str
    node_ip: str
    slice_name: Optional[str]
    worker_id: Optional[int]
    chip: Optional[int] = None


@dataclasses.dataclass
class SliceReservation:
    """Reserved devices, in (TPU worker id, chip) order, and the ``TPU_*``
    variables that describe them as a slice (empty for a whole slice)."""

    topology: Topology
    handle: object  # has .shutdown()
    placement_group: object
    devices: list[DevicePlace]
    env_by_host: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    whole_slice: bool = True

    @property
    def node_ips(self) -> list[str]:
        return [d.node_ip for d in self.devices]

    def env(self, device: DevicePlace) -> dict[str, str]:
        return dict(self.env_by_host.get(device.node_ip, {}))

    def shutdown(self) -> None:
        self.handle.shutdown()


def reserve_slice(topology: Topology, *, name: str = "", timeout_s: float = 120.0) -> SliceReservation:
    """A whole slice, one bundle per chip."""
    import ray
    from ray.util.tpu import SlicePlacementGroup

    handle = SlicePlacementGroup(
        topology=topology.name,
        accelerator_version=topology.accelerator_type,
        resources_per_bundle={"TPU": 1, "CPU": 1},
        strategy="STRICT_PACK" if topology.num_hosts == 1 else "SPREAD",
        name=name,
        # Ray pins a multi-host slice's bundles to its slice name, but a single-host
        # slice's to nothing: without this, a 2x2x1 could take one host of a 2x2x4.
        bundle_label_selector=[{C.LABEL_TPU_TOPOLOGY: topology.name}] * topology.num_devices,
    )
    _wait(handle, handle.placement_group, timeout_s, f"a free {topology} slice for {name or 'a placement group'}")
    return SliceReservation(topology, handle, handle.placement_group, probe_devices(handle.placement_group))


def half_topology(topology: Topology) -> Topology:
    """The slice shape of each half of ``topology`` (whole hosts), or ValueError."""
    fix = "use one_slice=False with two slices, or a larger slice"
    if topology.num_hosts < 2 or topology.num_hosts % 2:
        raise ValueError(f"GRPOConfig(one_slice=True): {topology} has {topology.num_hosts} host(s) and cannot be "
                         f"split into two halves of whole hosts (Ray's sub-slices are whole hosts); {fix}")
    for name in valid_topologies(topology.accelerator_type):
        half = Topology.parse(name, topology.accelerator_type)
        if half.num_chips * 2 == topology.num_chips and all(a <= b for a, b in zip(half.bounds, topology.bounds)):
            if half.num_hosts * 2 != topology.num_hosts:
                raise ValueError(
                    f"GRPOConfig(one_slice=True): the halves of {topology} are {half.name} sub-slices of "
                    f"{topology.num_hosts // 2} hosts, but a {half.accelerator_type} {half.name} slice is "
                    f"{half.num_hosts} host(s) in ray_train_tpu.topology, so the trainer's half cannot be described "
                    f"as a slice; {fix}")
            return half
    raise ValueError(f"GRPOConfig(one_slice=True): {topology} has no half that is a slice shape; {fix}")


def reserve_halves(topology: Topology, *, simulated: bool, timeout_s: float = 120.0
                   ) -> tuple[SliceReservation, SliceReservation]:
    """The trainer's half (Ray's `SubslicePlacementGroup`) and the engines' (the other hosts)."""
    half = half_topology(topology)
    dph = topology.devices_per_host
    try:
        sub = reserve_subslice(half, resources_per_bundle={"TPU": dph, "CPU": dph}, name="grpo-trainer-half",
                               simulated=simulated)
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"one_slice: Ray found no free {half.name} half of a {topology} slice: {e}") from e
    _wait(sub, sub.placement_group, timeout_s, f"the trainer's {half.name} half of {topology}")
    if sub.parent_topology != topology.name:
        sub.shutdown()
        raise RuntimeError(f"one_slice: Ray offered a {half.name} part of a {sub.parent_topology} slice, not a half "
                           f"of a {topology.name} one; is a {topology} slice free?")
    try:
        trainer_hosts = [int(sel[C.LABEL_TPU_WORKER_ID]) for sel in sub.bundle_label_selector]
        trainer_devices = [dataclasses.replace(d, chip=None) for d in probe_devices(sub.placement_group, per_bundle=dph)]
        env = _half_env(half, sub.slice_name + "-trainer", trainer_devices, trainer_hosts)
        trainer = SliceReservation(half, sub, sub.placement_group, trainer_devices, env, whole_slice=False)
        rollout = _reserve_other_hosts(topology, half, sub.slice_name, trainer_hosts, timeout_s)
    except BaseException:
        sub.shutdown()
        raise
    return trainer, rollout


def reserve_subslice(sub: Topology, *, resources_per_bundle: dict, name: str, simulated: bool):
    """Ray's `SubslicePlacementGroup` of shape `sub` (one bundle per host of an
    ICI-connected part of a larger slice, chosen by Ray from the chips'
    coordinates; on simulated hosts, from `simulated_chip_coords`; a host whose
    chips are all taken is seen as busy: `zero_filled_availability`). Raises
    Ray's RuntimeError when no such part is free, ValueError when no slice of
    the cluster has one. Does not wait for the bundles (``placement_group.ready()``).
    The RL trainer's half and serving replicas on sub-slices
    (`ray_train_tpu.serve._subslice`) both reserve through it."""
    import contextlib

    from ray.util.tpu import subslice_placement_group

    from ray_train_tpu._compat import ray_train as compat_ray

    discovery = compat_ray.simulated_subslice_discovery(simulated_chip_coords) if simulated else contextlib.nullcontext()
    with discovery, compat_ray.zero_filled_availability():
        return subslice_placement_group(sub.name, sub.generation.pod_prefix, resources_per_bundle=resources_per_bundle,
                                        name=name)


def _half_env(half: Topology, name: str, devices: list[DevicePlace], hosts: list[int]) -> dict:
    order = {w: i for i, w in enumerate(sorted(hosts))}
    return {d.node_ip: {C.TPU_NAME: name, C.TPU_TOPOLOGY: half.name, C.TPU_ACCELERATOR_TYPE: half.pod_type,
                        C.TPU_WORKER_ID: str(order[d.worker_id])} for d in devices}


def _reserve_other_hosts(topology: Topology, half: Topology, slice_name: str, taken: list[int],
                         timeout_s: float) -> SliceReservation:
    from ray.util.placement_group import placement_group, remove_placement_group

    others = [w for w in range(topology.num_hosts) if w not in taken]
    selectors = [{C.LABEL_TPU_SLICE_NAME: slice_name, C.LABEL_TPU_WORKER_ID: str(w)}
                 for w in others for _ in range(topology.devices_per_host)]
    pg = placement_group([{"TPU": 1, "CPU": 1} for _ in selectors], strategy="PACK", name="grpo-rollout-half",
                         bundle_label_selector=selectors)

    class _Handle:
        def shutdown(self):
            remove_placement_group(pg)

    handle = _Handle()
    _wait(handle, pg, timeout_s, f"the engines' half (hosts {others}) of {slice_name}")
    return SliceReservation(half, handle, pg, probe_devices(pg), whole_slice=False)


def _wait(handle, pg, timeout_s: float, what: str) -> None:
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        handle.shutdown()
        raise RuntimeError(f"no {what} within {timeout_s:.0f} s: the cluster's slices are in use or too small") from None


def _bundle_place() -> tuple[str, list[str]]:
    import ray

    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(i) for i in ctx.get_accelerator_ids().get("TPU", [])]


def probe_devices(pg, per_bundle: int = 1) -> list[DevicePlace]:
    """Where each bundle landed (a zero-CPU task per bundle asks), in (TPU
    worker id, chip) order; ``per_bundle`` devices share a multi-chip bundle."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    n = len(placement_group_table(pg)["bundles"])
    probe = ray.remote(_bundle_place)
    refs = [probe.options(num_cpus=0, resources={"TPU": per_bundle}, scheduling_strategy=
                          PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
            for i in range(n)]
    nodes = {node["NodeID"]: node for node in ray.nodes()}
    out = []
    for i, (node_id, chips) in enumerate(ray.get(refs)):
        node = nodes.get(node_id, {})
        labels = node.get("Labels") or {}
        wid = labels.get(C.LABEL_TPU_WORKER_ID)
        for k in range(per_bundle):
            chip = int(chips[k]) if per_bundle == 1 and chips else None
            out.append(DevicePlace(bundle=i, node_id=node_id, node_ip=node.get("NodeManagerAddress", ""),
                                   slice_name=labels.get(C.LABEL_TPU_SLICE_NAME),
                                   worker_id=None if wid is None else int(wid), chip=chip))
    return sorted(out, key=lambda d: (d.worker_id if d.worker_id is not None else 1 << 30, d.chip or 0, d.bundle))


def simulated_chip_coords() -> list:
    """Runs on a simulated host: ``[(hostname, chip, coords)]`` for its chips, as
    Ray's subslice discovery expects from libtpu. The coordinates are the
    host's chips in the slice's mesh (`Topology.chip_coords`), listed in the
    axis order Ray 2.60 reads a topology string in (the last dimension first:
    ``_get_physical_worker_id_from_coords``); whether libtpu lists them so on a
    real v4/v5p slice is untested."""
    import socket

    from ray_train_tpu._worker_fns import this_host
    from ray_train_tpu.topology import generation_of_pod_type

    identity = this_host()  # GKE's variables, else Ray's labels (a simulated TPU VM has only the labels)
    topo = Topology.parse(identity.topology, generation_of_pod_type(identity.pod_type))
    worker = int(identity.worker_id)
    dims = len(topo.name.split("x"))
    return [(socket.gethostname(), i, list(reversed(topo.chip_coords(worker, i)[:dims])))
            for i in range(topo.chips_per_host)]
