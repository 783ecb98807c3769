"""From what each Ray worker reports about itself to its place in the job.

Pure: each worker answers with a typed `WorkerReport` (`_worker_fns.report`),
the backend turns those into a `WorkerInfo` per worker and calls `layout`, which
checks that the workers form whole slices with one device each and returns the
rank of every worker and the hosts in TPU worker id order, ready for
`launch_env.launch_envs`. Nothing here depends on the order in which Ray
started the workers or the hosts registered.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from typing import Optional, Sequence

from ray_train_tpu import constants as C
from ray_train_tpu.launch_env import rank_of
from ray_train_tpu.topology import Topology


class Mode(str, enum.Enum):
    """How a job's TPU workers run: on real chips, or explicitly simulated on CPU.

    A ``str`` enum, so ``Mode.SIMULATE == "simulate"``.

    Example:
        >>> Mode("simulate") is Mode.SIMULATE, str(Mode.TPU)
        (True, 'tpu')
    """

    TPU = "tpu"
    SIMULATE = "simulate"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What one worker says about itself before the process group exists
    (`ray_train_tpu._worker_fns.report` builds it inside the worker).

    Example:
        >>> r = WorkerReport(node_ip="10.0.0.2", node_id="n", slice_name="s", tpu_worker_id=1,
        ...                  accelerator_type="v4-16", topology="2x2x2", tpu_ids=(3,))
        >>> r.info(index=7, node_tpus=4).where()
        'worker 7 on host 10.0.0.2 (TPU_NAME=s, TPU_WORKER_ID=1)'
    """

    node_ip: str
    node_id: str
    slice_name: Optional[str]  # TPU_NAME of the host
    tpu_worker_id: Optional[int]  # TPU_WORKER_ID of the host (None if unset or not an integer)
    accelerator_type: Optional[str]  # TPU_ACCELERATOR_TYPE of the host (a pod type, e.g. "v4-16")
    topology: Optional[str]  # TPU_TOPOLOGY of the host
    tpu_ids: tuple[int, ...] = ()  # Ray's TPU accelerator ids of this worker
    gpu_ids: tuple[int, ...] = ()
    mode: Mode = Mode.TPU
    preset: dict = dataclasses.field(default_factory=dict)  # our variables already set for it

    def info(self, index: int, node_tpus: float) -> "WorkerInfo":
        """The `WorkerInfo` that `layout` ranks, for the worker at `index`."""
        return WorkerInfo(index=index, node_ip=self.node_ip, slice_name=self.slice_name,
                          tpu_worker_id=self.tpu_worker_id, tpu_ids=self.tpu_ids, node_tpus=node_tpus)

    def as_dict(self) -> dict:
        """The report as the dict that `ray_train_tpu.serve` reads (``worker_id``
        as a string, ``simulate`` as a bool)."""
        out = dataclasses.asdict(self)
        out["worker_id"] = None if self.tpu_worker_id is None else str(out.pop("tpu_worker_id"))
        out.pop("tpu_worker_id", None)
        out["simulate"] = out.pop("mode") == Mode.SIMULATE
        out["tpu_ids"], out["gpu_ids"] = list(self.tpu_ids), list(self.gpu_ids)
        return out


def job_mode(reports: Sequence[WorkerReport]) -> Mode:
    """The one `Mode` of all workers; ValueError when some simulate and others not."""
    modes = {r.mode for r in reports}
    if len(modes) > 1:
        raise ValueError(
            f"{C.RAY_TRAIN_TPU_SIMULATE}=1 is set on some workers but not others; a "
            "slice is either simulated or real: set it on every host or on none"
        )
    return modes.pop() if modes else Mode.TPU


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What `layout` needs to rank one worker."""

    index: int  # position in Ray's worker group
    node_ip: str
    slice_name: Optional[str]  # TPU_NAME of the host
    tpu_worker_id: Optional[int]  # TPU_WORKER_ID of the host
    tpu_ids: tuple[int, ...]  # Ray's TPU accelerator ids of this worker
    node_tpus: float  # TPU resources of the worker's host

    def where(self) -> str:
        return (
            f"worker {self.index} on host {self.node_ip} (TPU_NAME={self.slice_name}, "
            f"TPU_WORKER_ID={self.tpu_worker_id})"
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    ranks: list[int]  # ranks[i] = rank of the worker at index i
    hosts: list[str]  # host addresses by node rank (slice-major, TPU worker id order)
    slice_names: list[str]  # slice names by slice id

    def index_of_rank(self) -> list[int]:
        """Ray worker index of each rank."""
        order = [0] * len(self.ranks)
        for index, rank in enumerate(self.ranks):
            order[rank] = index
        return order


class LayoutError(ValueError):
    """The workers do not form whole slices of one device per worker."""


def layout(infos: Sequence[WorkerInfo], topology: Topology, num_slices: int) -> Layout:
    """Check the workers and give each its rank.

    Slices are ordered by name, hosts by TPU worker id, devices by Ray's TPU
    accelerator id on the host (the chip index of ``TPU_VISIBLE_CHIPS``, or
    the TensorCore index on v7x).

    Raises:
        LayoutError: naming the workers and hosts at fault and the fix.
    """
    _check_one_device_each(infos)
    expected = topology.num_devices * num_slices
    if len(infos) != expected:
        raise LayoutError(
            f"{len(infos)} workers cannot fill {num_slices} x {topology}: it needs "
            f"{expected} (one per device); use TPUScalingConfig(topology=..., "
            "accelerator_type=..., num_slices=...) to size the job"
        )
    _check_host_identity(infos)
    by_slice: dict[str, list[WorkerInfo]] = defaultdict(list)
    for info in infos:
        by_slice[info.slice_name].append(info)
    if len(by_slice) != num_slices:
        names = ", ".join(sorted(map(str, by_slice)))
        raise LayoutError(
            f"workers span {len(by_slice)} TPU slice(s) ({names}) but the job asks for "
            f"{num_slices}; each slice must be whole, so check TPU_NAME on every host"
        )
    slice_names = sorted(by_slice)
    ranks = [0] * len(infos)
    hosts = [""] * (topology.num_hosts * num_slices)
    for slice_id, name in enumerate(slice_names):
        for worker_id, host_infos in _hosts_of_slice(by_slice[name], topology, name).items():
            hosts[slice_id * topology.num_hosts + worker_id] = host_infos[0].node_ip
            for info in host_infos:
                local_rank = info.tpu_ids[0]
                ranks[info.index] = rank_of(topology, slice_id=slice_id, worker_id=worker_id, local_rank=local_rank)
    return Layout(ranks=ranks, hosts=hosts, slice_names=slice_names)


def _check_one_device_each(infos: Sequence[WorkerInfo]) -> None:
    bad = [i for i in infos if len(i.tpu_ids) != 1]
    if bad:
        details = "; ".join(f"{i.where()} holds {len(i.tpu_ids)} TPU device(s) {list(i.tpu_ids)}" for i in bad[:4])
        raise LayoutError(
            f"ray_train_tpu runs exactly one TPU device per worker, but {details}; "
            "set resources_per_worker={'TPU': 1} (TPUScalingConfig does)"
        )


def _check_host_identity(infos: Sequence[WorkerInfo]) -> None:
    for info in infos:
        if info.slice_name is None or info.tpu_worker_id is None:
            raise LayoutError(
                f"{info.where()} does not say which slice and host it is: TPU_NAME and "
                "TPU_WORKER_ID must be set on every TPU host (GKE's TPU webhook and "
                "ray_train_tpu.testing.simulated_tpu_cluster set them)"
            )
    ips = defaultdict(set)
    for info in infos:
        ips[(info.slice_name, info.tpu_worker_id)].add(info.node_ip)
    for (name, worker_id), addrs in ips.items():
        if len(addrs) > 1:
            raise LayoutError(
                f"TPU_WORKER_ID={worker_id} of slice {name} is claimed by several hosts "
                f"({', '.join(sorted(addrs))}); every host of a slice needs its own id"
            )


def _hosts_of_slice(infos: list[WorkerInfo], topology: Topology, name: str) -> dict[int, list[WorkerInfo]]:
    by_host: dict[int, list[WorkerInfo]] = defaultdict(list)
    for info in infos:
        by_host[info.tpu_worker_id].append(info)
    want = set(range(topology.num_hosts))
    if set(by_host) != want:
        missing = sorted(want - set(by_host))
        extra = sorted(set(by_host) - want)
        raise LayoutError(
            f"slice {name} is not whole: TPU worker ids {sorted(by_host)} have workers, "
            f"{topology} needs 0..{topology.num_hosts - 1}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
        )
    for worker_id, host_infos in by_host.items():
        _check_host_devices(host_infos, topology, name, worker_id)
    return by_host


def _check_host_devices(host_infos: list[WorkerInfo], topology: Topology, name: str, worker_id: int) -> None:
    ip = host_infos[0].node_ip
    node_tpus = {i.node_tpus for i in host_infos}
    if node_tpus != {topology.devices_per_host}:
        raise LayoutError(
            f"host {ip} (slice {name}, TPU_WORKER_ID={worker_id}) reports "
            f"{sorted(node_tpus)} TPU resources but a {topology} host has "
            f"{topology.devices_per_host}; every host of a slice must report the same "
            "chip count (check the node's TPU resource and RAY_TPU_RESOURCE_PER_CHIP)"
        )
    ids = sorted(i.tpu_ids[0] for i in host_infos)
    if ids != list(range(topology.devices_per_host)):
        raise LayoutError(
            f"host {ip} (slice {name}, TPU_WORKER_ID={worker_id}) runs workers on TPU "
            f"ids {ids}; a {topology} host needs one worker on each of "
            f"0..{topology.devices_per_host - 1}"
        )
