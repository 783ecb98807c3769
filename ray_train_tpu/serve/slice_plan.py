"""Which placement-group bundle holds which vLLM worker, and each worker's
TorchTPU environment: pure functions, no Ray, no vLLM.

A replica's slice placement group has one bundle per device (``{"TPU": 1}``);
Ray decides which host, and which chip on it, each bundle gets, and that
changes from run to run. vLLM's Ray executor puts worker ``rank`` in bundle
``VLLM_RAY_BUNDLE_INDICES[rank]``. `plan_slice` orders the bundles by (TPU
worker id of the host, chip), so that ranks follow the slice the way
torch_tpu's launcher numbers it: rank = worker id x devices per host + chip.
Every worker's environment then comes from `launch_env` (the training code
path), and vllm-torchtpu's executor conventions match it (hosts in
``ray.io/tpu-worker-id`` order, slice-builder address ``ip:8070+chip``;
``vllm_torchtpu/executors/ray_distributed_executor_v2.py``).

Example:
    >>> from ray_train_tpu.topology import Topology
    >>> t = Topology.parse("2x2x2", "TPU-V4")
    >>> bundles = [BundlePlace(index=i, node_id=f"n{1 - i // 4}", node_ip=f"10.0.0.{2 - i // 4}",
    ...                        slice_name="s", worker_id=1 - i // 4, chip=i % 4) for i in range(8)]
    >>> plan = plan_slice(t, bundles, xprof_session_id="1")
    >>> plan.bundle_indices, plan.hosts
    ([4, 5, 6, 7, 0, 1, 2, 3], ['10.0.0.1', '10.0.0.2'])
    >>> plan.worker_env(5)["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[5]
    '10.0.0.2:8071'
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from ray_train_tpu import constants as C
from ray_train_tpu.launch_env import launch_env
from ray_train_tpu.topology import Topology


@dataclasses.dataclass(frozen=True, kw_only=True)
class BundlePlace:
    """Where one bundle of the placement group landed."""

    index: int  # bundle index in the placement group
    node_id: str
    node_ip: str
    slice_name: str | None  # ray.io/tpu-slice-name of the node
    worker_id: int | None  # ray.io/tpu-worker-id of the node
    chip: int  # the TPU id Ray gives whoever runs in the bundle


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlicePlan:
    """A replica's workers: rank r runs in bundle ``bundle_indices[r]`` on host
    ``hosts[r // devices_per_host]``, chip ``r % devices_per_host``."""

    topology: str
    accelerator_type: str
    slice_name: str
    hosts: tuple[str, ...]  # node IPs in TPU worker id order
    bundle_indices: tuple[int, ...]  # by rank
    xprof_session_id: str

    @property
    def parsed(self) -> Topology:
        return Topology.parse(self.topology, self.accelerator_type)

    def place(self, rank: int) -> tuple[int, int]:
        """(TPU worker id, chip) of `rank`."""
        return divmod(rank, self.parsed.devices_per_host)

    def worker_env(self, rank: int) -> dict[str, str]:
        """The TorchTPU environment of worker `rank` (`launch_env`)."""
        return launch_env(self.parsed, list(self.hosts), rank=rank, xprof_session_id=self.xprof_session_id)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SlicePlan":
        d = json.loads(text)
        return cls(**{**d, "hosts": tuple(d["hosts"]), "bundle_indices": tuple(d["bundle_indices"])})


def plan_slice(topology: Topology, bundles: Sequence[BundlePlace], *, xprof_session_id: str) -> SlicePlan:
    """Order the bundles of one replica's placement group by (TPU worker id,
    chip). Raises RuntimeError unless they are exactly the slice's devices:
    one slice, every host 0..N-1, every chip of each once."""
    dph = topology.devices_per_host
    want = topology.num_devices
    where = ", ".join(f"bundle {b.index}: {b.slice_name}/w{b.worker_id}/chip {b.chip}" for b in bundles)
    slices = {b.slice_name for b in bundles}
    places = sorted((b.worker_id, b.chip) for b in bundles if b.worker_id is not None)
    expected = [(w, c) for w in range(topology.num_hosts) for c in range(dph)]
    if len(bundles) != want or len(slices) != 1 or None in slices or places != expected:
        raise RuntimeError(
            f"the replica's placement group is not the {want} devices of one {topology} "
            f"(one bundle per device, hosts by ray.io/tpu-worker-id 0..{topology.num_hosts - 1}, "
            f"chips 0..{dph - 1} each): {where}"
        )
    ordered = sorted(bundles, key=lambda b: (b.worker_id, b.chip))
    hosts = [ordered[w * dph].node_ip for w in range(topology.num_hosts)]
    for w in range(topology.num_hosts):
        ips = {b.node_ip for b in ordered[w * dph:(w + 1) * dph]}
        if len(ips) != 1:
            raise RuntimeError(f"TPU worker id {w} of {slices.pop()} is on several nodes {sorted(ips)}: {where}")
    if len(set(hosts)) != len(hosts):
        raise RuntimeError(f"two TPU worker ids share a node address {hosts}: {where}")
    return SlicePlan(
        topology=topology.name,
        accelerator_type=topology.accelerator_type,
        slice_name=str(next(iter(slices))),
        hosts=tuple(hosts),
        bundle_indices=tuple(b.index for b in ordered),
        xprof_session_id=xprof_session_id,
    )


def check_worker_place(plan: SlicePlan, rank: int, *, worker_id: str | None, slice_name: str | None,
                       chips: Sequence[int]) -> None:
    """Raise RuntimeError unless vLLM worker `rank` runs where the plan put it
    (vLLM re-ranks workers by host address after placing them)."""
    want_w, want_chip = plan.place(rank)
    got = (slice_name, None if worker_id is None else int(worker_id), sorted(int(c) for c in chips))
    if got != (plan.slice_name, want_w, [want_chip]):
        raise RuntimeError(
            f"vLLM worker rank {rank} runs on {got[0]}/w{got[1]} chip(s) {got[2]}, but rank {rank} of "
            f"{plan.topology} is {plan.slice_name}/w{want_w} chip {want_chip} ({C.TPU_WORKER_ID} order); "
            "the slice's ranks would not match its devices"
        )
