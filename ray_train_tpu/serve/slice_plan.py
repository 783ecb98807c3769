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
    ((4, 5, 6, 7, 0, 1, 2, 3), ('10.0.0.1', '10.0.0.2'))
    >>> plan.worker_env(5)["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[5]
    '10.0.0.2:8071'
"""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Sequence

from ray_train_tpu import constants as C
from ray_train_tpu.launch_env import launch_env, reconcile
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


# What vllm-torchtpu's Ray executor gives every worker of a slice itself
# (``vllm_torchtpu/executors/ray_distributed_executor_v2.py``, step 7), all of
# which `launch_env` computes too: on a TPU they must agree, or the worker
# would join another slice (or the right slice at the wrong rank).
ENGINE_SET_KEYS: tuple[str, ...] = (
    C.TORCH_TPU_SLICEBUILDER_ADDRESSES,
    C.TORCH_TPU_TOPOLOGY,
    C.NNODES,
    C.NODE_RANK,
    C.MASTER_ADDR,
    C.LOCAL_WORLD_SIZE,
)


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """What a vLLM worker's environment becomes before its device starts."""

    set: dict  # variables to set
    unset: tuple  # job variables the host carries that this slice must not see


def slice_worker_env(plan: SlicePlan, rank: int, *, local_rank: int, chips: Sequence[int],
                     host_env: Mapping[str, str], engine_env: Mapping[str, str], simulated: bool) -> WorkerEnv:
    """The env/place check every vLLM worker of a slice runs before its device
    starts, the same in simulation and on TPUs (``SliceWorkerProc``).

    Raises RuntimeError unless worker `rank` runs where the plan puts it (its
    host's ``TPU_NAME``/``TPU_WORKER_ID`` in `host_env`, the one chip Ray gave
    it in `chips`), its `local_rank` (which torch_tpu turns into the chip it
    opens) is that chip, and, on a TPU, every variable of `ENGINE_SET_KEYS` that
    the engine's executor set (`engine_env`) equals `launch_env`'s. In
    simulation the worker is given `launch_env`'s whole environment (vLLM's
    CPU platform sets none of it). Either way a job variable the host still
    carries from another job (``MEGASCALE_*``) is removed.

    Example:
        >>> from ray_train_tpu.topology import Topology
        >>> t = Topology.parse("2x2x1", "TPU-V4")
        >>> plan = plan_slice(t, [BundlePlace(index=i, node_id="n", node_ip="10.0.0.1", slice_name="s",
        ...                                   worker_id=0, chip=3 - i) for i in range(4)], xprof_session_id="1")
        >>> host = {"TPU_NAME": "s", "TPU_WORKER_ID": "0", "MEGASCALE_PORT": "8081"}
        >>> env = slice_worker_env(plan, 2, local_rank=2, chips=[2], host_env=host, engine_env={}, simulated=True)
        >>> env.set["TORCH_TPU_SLICEBUILDER_ADDRESSES"], env.set["LOCAL_RANK"], env.unset
        ('10.0.0.1:8070,10.0.0.1:8071,10.0.0.1:8072,10.0.0.1:8073', '2', ('MEGASCALE_PORT',))
        >>> slice_worker_env(plan, 2, local_rank=1, chips=[2], host_env=host, engine_env={}, simulated=True)
        Traceback (most recent call last):
        ...
        RuntimeError: vLLM worker rank 2 has local rank 1 but holds chip 2 of its host; torch_tpu would open chip 1
    """
    check_worker_place(plan, rank, worker_id=host_env.get(C.TPU_WORKER_ID), slice_name=host_env.get(C.TPU_NAME),
                       chips=chips)
    chip = plan.place(rank)[1]
    if int(local_rank) != chip:
        raise RuntimeError(
            f"vLLM worker rank {rank} has local rank {local_rank} but holds chip {chip} of its host; "
            f"torch_tpu would open chip {local_rank}"
        )
    ours = plan.worker_env(rank)
    unset = reconcile(ours, host_env, {}).unset
    if simulated:
        return WorkerEnv(set=ours, unset=unset)
    wrong = {k: (engine_env.get(k), ours[k]) for k in ENGINE_SET_KEYS if _norm(k, engine_env.get(k)) != _norm(k, ours[k])}
    if wrong:
        raise RuntimeError(
            f"vLLM worker rank {rank} of slice {plan.slice_name} was given an environment that does not "
            f"describe its slice ({plan.topology}, hosts {list(plan.hosts)}): "
            + "; ".join(f"{k}={got!r}, expected {want!r}" for k, (got, want) in wrong.items())
        )
    return WorkerEnv(set={}, unset=unset)


def _norm(key: str, value: str | None) -> str | None:
    # torch_tpu reads "2x2x2" and "2,2,2" alike (vllm-torchtpu normalises to commas).
    return value.replace("x", ",") if key == C.TORCH_TPU_TOPOLOGY and value else value
