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
import re
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
    # An engine on a sub-slice of a larger slice (`engine_topology`): the
    # parent slice's TPU worker ids of its hosts (engine host w is parent worker
    # ``worker_ids[w]``) and, on part of one host, Ray's chip of each rank.
    # Empty: the engine owns the whole slice (host w is worker w, rank r chip r % devices per host).
    worker_ids: tuple[int, ...] = ()
    chips: tuple[int, ...] = ()

    @property
    def parsed(self) -> Topology:
        return engine_topology(self.topology, self.accelerator_type)

    def place(self, rank: int) -> tuple[int, int]:
        """(TPU worker id, chip) of `rank`, as its host knows them (the parent
        slice's worker id and Ray's chip for an engine on a sub-slice)."""
        w, c = divmod(rank, self.parsed.devices_per_host)
        return (self.worker_ids[w] if self.worker_ids else w), (self.chips[rank] if self.chips else c)

    def worker_env(self, rank: int) -> dict[str, str]:
        """The TorchTPU environment of worker `rank` (`launch_env` of the
        engine's own slice). An engine on part of one host has its own
        slice-builder and rendezvous ports (the base ports plus its first chip)
        and sees its own chip, so that the engines sharing a host never meet."""
        if not self.chips:
            return launch_env(self.parsed, list(self.hosts), rank=rank, xprof_session_id=self.xprof_session_id)
        first = min(self.chips)
        env = launch_env(self.parsed, list(self.hosts), rank=rank, xprof_session_id=self.xprof_session_id,
                         base_port=C.DEFAULT_TORCH_TPU_BASE_PORT + first, master_port=C.DEFAULT_MASTER_PORT + first)
        env[C.TPU_VISIBLE_CHIPS] = str(self.chips[rank])
        return env

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SlicePlan":
        d = json.loads(text)
        return cls(**{**d, **{k: tuple(d.get(k, ())) for k in ("hosts", "bundle_indices", "worker_ids", "chips")}})


def engine_topology(name: str, accelerator_type: str) -> Topology:
    """The slice an engine owns: a slice shape of the generation
    (`Topology.parse`), or part of one host (1, 2 or 4 chips, the chip bounds Ray
    gives a process holding that many: ``1x1x1``, ``1x2x1``, ``2x2x1``; see
    `layout_planner.engine_shapes`), which is no slice of its own on v4/v5p/v7x."""
    try:
        return Topology.parse(name, accelerator_type)
    except ValueError:
        from ray_train_tpu.topology import get_generation

        gen = get_generation(accelerator_type)
        text = str(name).lower()
        dims = tuple(int(d) for d in text.split("x")) if re.fullmatch(r"\d+(x\d+){1,2}", text) else ()
        bounds = dims + (1,) * (3 - len(dims))
        if len(dims) != gen.num_dims or bounds not in _SUB_HOST_BOUNDS or _prod(bounds) > gen.max_single_host_chips:
            raise
        return Topology(generation=gen, name=name.lower(), bounds=bounds, host_bounds=bounds)


# Chip bounds of an engine on part of one host, as Ray sets TPU_CHIPS_PER_HOST_BOUNDS
# for a process that holds 1, 2 or 4 chips.
_SUB_HOST_BOUNDS = {(1, 1, 1), (1, 2, 1), (2, 2, 1)}


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def plan_slice(topology: Topology, bundles: Sequence[BundlePlace], *, xprof_session_id: str,
               parent: Topology | None = None) -> SlicePlan:
    """Order the bundles of one engine's placement group by (TPU worker id,
    chip). Raises RuntimeError unless they are exactly the engine's devices:
    one slice, every host 0..N-1, every chip of each once. With `parent` (the
    slice that `topology` is a sub-slice of): the hosts are any N hosts of one
    parent slice (renumbered 0..N-1 in worker id order, as a sub-slice's own
    slice), and on part of one host, any chips of it."""
    dph = topology.devices_per_host
    want = topology.num_devices
    sub = parent is not None and parent.name != topology.name
    part_of_host = sub and dph < parent.devices_per_host
    where = ", ".join(f"bundle {b.index}: {b.slice_name}/w{b.worker_id}/chip {b.chip}" for b in bundles)
    slices = {b.slice_name for b in bundles}
    ids = sorted({b.worker_id for b in bundles if b.worker_id is not None}) if sub else list(range(topology.num_hosts))
    local = {w: i for i, w in enumerate(ids)}
    places = sorted((local.get(b.worker_id, -1), b.chip) for b in bundles if b.worker_id is not None)
    chips_ok = (len({p for p in places}) == want) if part_of_host else (
        places == [(w, c) for w in range(topology.num_hosts) for c in range(dph)])
    if len(bundles) != want or len(slices) != 1 or None in slices or len(ids) != topology.num_hosts \
            or len(places) != want or not chips_ok:
        what = f"of one {parent} sub-slice" if sub else f"of one {topology}"
        raise RuntimeError(
            f"the replica's placement group is not the {want} devices {what} "
            f"(one bundle per device, hosts by ray.io/tpu-worker-id{'' if sub else f' 0..{topology.num_hosts - 1}'}, "
            f"{'distinct chips' if part_of_host else f'chips 0..{dph - 1} each'}): {where}"
        )
    ordered = sorted(bundles, key=lambda b: (b.worker_id, b.chip))
    hosts = [ordered[w * dph].node_ip for w in range(topology.num_hosts)]
    for w in range(topology.num_hosts):
        ips = {b.node_ip for b in ordered[w * dph:(w + 1) * dph]}
        if len(ips) != 1:
            raise RuntimeError(f"TPU worker id {ids[w]} of {slices.pop()} is on several nodes {sorted(ips)}: {where}")
    if len(set(hosts)) != len(hosts):
        raise RuntimeError(f"two TPU worker ids share a node address {hosts}: {where}")
    return SlicePlan(
        topology=topology.name,
        accelerator_type=topology.accelerator_type,
        slice_name=str(next(iter(slices))),
        hosts=tuple(hosts),
        bundle_indices=tuple(b.index for b in ordered),
        xprof_session_id=xprof_session_id,
        worker_ids=tuple(ids) if sub else (),
        chips=tuple(b.chip for b in ordered) if part_of_host else (),
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
        RuntimeError: vLLM worker rank 2 has local rank 1 but holds chip 2 of its host; torch_tpu would open device 1
    """
    check_worker_place(plan, rank, worker_id=host_env.get(C.TPU_WORKER_ID), slice_name=host_env.get(C.TPU_NAME),
                       chips=chips)
    # The engine's own device index on the host (the chip itself, on a whole host).
    chip = rank % plan.parsed.devices_per_host
    if int(local_rank) != chip:
        held = f"chip {chip} of its host" if not plan.chips else f"device {chip} of its engine (chip {plan.chips[rank]})"
        raise RuntimeError(
            f"vLLM worker rank {rank} has local rank {local_rank} but holds {held}; "
            f"torch_tpu would open device {local_rank}"
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
