"""The Ray Train backend of `TPUTorchConfig`: ``on_start`` and ``on_shutdown``.

``on_start`` asks every worker where it is (a typed `WorkerReport`: host,
slice, TPU worker id, chip), checks that the workers form whole slices with one
device each (`ray_train_tpu.discovery`), computes every worker's environment
with `ray_train_tpu.launch_env` (the same function ``plan`` prints), sets it in
each worker before torch_tpu reads it, and builds the process group:

- ``tpu_dist`` on real TPUs, after checking that torch_tpu registered a
  ``"tpu"`` device and the ``tpu_dist`` backend (never a silent CPU fallback);
- in explicit simulation (``RAY_TRAIN_TPU_SIMULATE=1`` in the workers'
  environment, as `ray_train_tpu.testing.simulated_tpu_cluster` sets it) the
  same ``tpu_dist`` name on a simulated ``tpu`` device, gloo underneath
  (`ray_train_tpu._compat.simulated_tpu`): a host tensor in a collective of
  the job's group fails there as it does on a TPU;
- ``nccl`` (or gloo) through Ray's own TorchConfig backend when the workers
  hold GPUs (or nothing) instead of TPUs.

torch_tpu reads its variables lazily, on first device or process-group use,
and only once (``GetEnvOnce``); importing it reads none of them
(tests/unit/test_torch_tpu_env_timing.py). ``on_start`` runs before the
training function, so the environment is complete before anything reads it.

The backend receives its `TPUTorchConfig` as Ray's ``Backend.on_start`` gets
any config, typed as Ray's base (``TorchConfig``): `ray_train_tpu.config`
imports this module for ``backend_cls``, never the other way round.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import ray
from ray.train.torch import TorchConfig

from ray_train_tpu import _worker_fns
from ray_train_tpu import constants as C
from ray_train_tpu.checkpoint.preemption import install_handler as install_preemption_handler
from ray_train_tpu._compat import ray_tpu as compat_ray_tpu
from ray_train_tpu._compat import ray_train as compat_ray
from ray_train_tpu.discovery import Layout, Mode, WorkerReport, job_mode, layout, order_slice_hosts
from ray_train_tpu.hang import CollectiveHangError, CollectiveWatch, HangDetector
from ray_train_tpu.hang import ranges as _ranges
from ray_train_tpu.launch_env import check_override, launch_envs, reconcile
from ray_train_tpu.prepare import set_worker_context
from ray_train_tpu.topology import Topology, generation_of_pod_type

logger = logging.getLogger(__name__)

# Ray computes these ranks too; ours must agree, so a preset value never wins.
_RANK_KEYS = (C.RANK, C.WORLD_SIZE, C.LOCAL_RANK, C.LOCAL_WORLD_SIZE, C.NODE_RANK, C.NNODES, C.TPU_VISIBLE_CHIPS)



def _host_positions(slice_name, claims) -> dict:
    """Ray Train's worker sort places hosts exactly as `layout` does."""
    return order_slice_hosts(slice_name, claims).positions


# The controller imports this module when it unpickles a TPUTorchConfig, before
# it ranks the workers: that is where Ray's TPU worker order must be fixed, and
# where Ray Train reserves its slices (only intact ones: docs/elastic.md).
compat_ray.install_tpu_worker_order(identify=_worker_fns.host_identity, host_positions=_host_positions)
compat_ray_tpu.install_slice_reservation()


class _TPUTorchBackend(compat_ray.RayTorchBackend):
    share_cuda_visible_devices: bool = True
    # Ranks still busy in a roll call or rendezvous that timed out: shutdown must
    # not queue a call behind them (a stalled host would hold it to its timeout).
    _busy_ranks: frozenset = frozenset()

    def on_start(self, worker_group, backend_config: TorchConfig):
        try:
            self._start(worker_group, backend_config)
        except BaseException:
            compat_ray.release_failed_worker_group(worker_group)
            raise

    def _start(self, worker_group, backend_config: TorchConfig):
        reports: list[WorkerReport] = worker_group.execute(_worker_fns.report)
        # On the workers' main threads (the training function runs in another one),
        # for checkpoint.PreemptionGuard; dormant until a guard is armed.
        worker_group.execute(install_preemption_handler)
        if not any(r.tpu_ids for r in reports):
            # No TPUs: GPUs or CPUs, exactly as Ray's own TorchConfig does it.
            logger.info("ray_train_tpu: workers hold no TPU; using Ray's TorchConfig backend")
            ray_config = TorchConfig(
                backend=None if backend_config.backend == "auto" else backend_config.backend,
                init_method="env",
                timeout_s=backend_config.timeout_s,
            )
            return super().on_start(worker_group, ray_config)
        mode = job_mode(reports)
        topology = _resolve_topology(reports, backend_config)
        num_slices = len({r.slice_name for r in reports})
        _check_num_slices(backend_config.num_slices, num_slices)
        placement = _layout(reports, topology, num_slices)
        envs = self._worker_envs(worker_group, reports, placement, topology, num_slices, backend_config, mode)
        ray.get([
            worker_group.execute_single_async(i, _worker_fns.apply_env, env=p.env, mode=mode, unset=p.unset)
            for i, p in enumerate(envs)
        ])
        backend = _choose_backend(backend_config.backend, mode)
        self._rendezvous(worker_group, backend, backend_config, placement)
        worker_group.execute(
            set_worker_context,
            strategy=backend_config.strategy,
            topology=topology.name,
            accelerator_type=topology.accelerator_type,
            num_slices=num_slices,
        )
        if backend_config.hang_timeout_s is not None:
            self._watch_collectives(worker_group, backend_config.hang_timeout_s, placement, reports)
        logger.info(
            "ray_train_tpu: %s process group of %d workers on %d x %s%s%s",
            backend, len(envs), num_slices, topology,
            "" if not isinstance(backend_config.num_slices, tuple) else
            f" (elastic {backend_config.num_slices[0]}..{backend_config.num_slices[1]} slices: "
            f"{', '.join(sorted({r.slice_name for r in reports}))})",
            " (SIMULATED: a 'tpu' device over CPU memory, gloo underneath)" if mode is Mode.SIMULATE else "",
        )

    def rank_order(self, reports: list, cfg: TorchConfig) -> list[int]:
        """Indices of the reporting workers in rank order (for groups that, unlike
        Ray Train's, are not ranked already)."""
        topology = _resolve_topology(reports, cfg)
        return layout(_infos(reports), topology, len({r.slice_name for r in reports})).index_of_rank()

    def _worker_envs(self, worker_group, reports, placement: Layout, topology, num_slices, cfg, mode):
        master_port = cfg.master_port
        if master_port is None:
            master_port = (
                worker_group.execute_single(0, _worker_fns.free_port, host=placement.hosts[0])
                if mode is Mode.SIMULATE
                else C.DEFAULT_MASTER_PORT
            )
        computed = launch_envs(
            topology,
            placement.hosts,
            num_slices=num_slices,
            xprof_session_id=str(time.time_ns()),
            base_port=cfg.base_port,
            master_port=master_port,
            megascale_port=cfg.megascale_port,
        )
        # ranks equal worker indices (checked in _layout), so computed[i] is worker i's
        plans = []
        for (place, env), report in zip(computed, reports):
            env_plan = reconcile(env, report.preset, cfg.extra_env, fixed=_RANK_KEYS)
            check_override(env_plan.env, place, topology, placement.hosts[place.node_rank], num_slices)
            plans.append(env_plan)
        _warn_env_changes(plans, cfg.extra_env)
        return plans

    def _rendezvous(self, worker_group, backend, cfg: TorchConfig, placement: Layout):
        """Roll call, then the process group, each bounded by rendezvous_timeout_s,
        so a host that never joins fails the attempt naming its ranks."""
        world_size = len(worker_group)
        try:
            calls = [worker_group.execute_single_async(i, _worker_fns.arrive) for i in range(world_size)]
            _wait_all(calls, cfg, placement, backend, "answer the roll call before the rendezvous")
            calls = [
                worker_group.execute_single_async(
                    i, _worker_fns.join_process_group, backend=backend, world_rank=i, world_size=world_size,
                    timeout_s=cfg.timeout_s,
                )
                for i in range(world_size)
            ]
            _wait_all(calls, cfg, placement, backend, f"join the {backend} process group")
        except _RendezvousTimeout as e:
            self._busy_ranks = frozenset(e.ranks)
            raise

    def _watch_collectives(self, worker_group, timeout_s: float, placement: Layout, reports) -> None:
        """Fail this attempt when a collective some ranks never join makes no
        progress for `timeout_s` (`ray_train_tpu.hang`), from Ray Train's poll."""
        hosts = [f"{placement.hosts[_node_rank(rank, placement)]} ({report.slice_name})"
                 for rank, report in enumerate(reports)]
        # c10d has no collective counters on tpu_dist: each worker counts its own entries and steps
        worker_group.execute(_worker_fns.start_progress_probes)
        watch = CollectiveWatch(
            ask=lambda rank: worker_group.execute_single_async(rank, _worker_fns.collective_progress),
            num_ranks=len(reports),
            detector=HangDetector(timeout_s, hosts, now=time.monotonic()),
            dump=_py_spy_on_host,
        )

        def on_poll(preempting: bool, failing: bool) -> None:
            if preempting or failing:  # Ray Train's own preemption and failure handling own this attempt
                return
            try:
                watch.poll()
            except CollectiveHangError:
                # Every rank may be inside a collective: shutdown must not queue calls behind them.
                self._busy_ranks = frozenset(range(len(reports)))
                raise

        if not compat_ray.add_worker_group_poll_hook(worker_group, on_poll):
            logger.info("ray_train_tpu: not a Ray Train worker group; hang detection is off")

    def on_shutdown(self, worker_group, backend_config):
        ranks = [i for i in range(len(worker_group)) if i not in self._busy_ranks]
        futures = [worker_group.execute_single_async(i, _worker_fns.leave_process_group) for i in ranks]
        try:
            ray.get(futures, timeout=30)
        except ray.exceptions.GetTimeoutError:
            logger.warning("ray_train_tpu: process group shutdown timed out after 30 s")


def _py_spy_on_host(pid: int, node_id: Optional[str]):
    """An ObjectRef of `hang.py_spy_frame(pid)`, run on the node of `pid` (a
    frozen worker cannot answer for itself)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_train_tpu import hang

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False) if node_id else "DEFAULT"
    return ray.remote(hang.py_spy_frame).options(num_cpus=0, scheduling_strategy=strategy, max_retries=0).remote(pid)


class _RendezvousTimeout(TimeoutError):
    def __init__(self, message: str, ranks: tuple = ()):  # ranks do not survive pickling
        super().__init__(message)
        self.ranks = ranks


def _wait_all(calls: list, cfg: TorchConfig, placement: Layout, backend: str, what: str) -> None:
    done, pending = ray.wait(calls, num_returns=len(calls), timeout=cfg.rendezvous_timeout_s)
    ray.get(done)  # a worker that failed raises its own error here
    if pending:
        missing = [calls.index(c) for c in pending]
        hosts = sorted({placement.hosts[_node_rank(r, placement)] for r in missing})
        raise _RendezvousTimeout(
            f"ray_train_tpu: {len(missing)} of {len(calls)} workers did not {what} within "
            f"rendezvous_timeout_s={cfg.rendezvous_timeout_s:g}: ranks {_ranges(missing)} on "
            f"host(s) {', '.join(hosts)}. Check that those hosts are up and reachable "
            f"(MASTER_ADDR={placement.hosts[0]}), or raise TPUTorchConfig(rendezvous_timeout_s=...)",
            missing,
        )


def _check_num_slices(wanted, live: int) -> None:
    """The live slices fit `TPUTorchConfig(num_slices=...)` (a count or an elastic range)."""
    low, high = wanted if isinstance(wanted, tuple) else (wanted, wanted)
    if wanted is not None and not low <= live <= high:
        raise ValueError(
            f"TPUTorchConfig(num_slices={wanted!r}) but the workers span {live} slice(s); size the job "
            "with TPUScalingConfig(num_slices=...) (a (min, max) range for an elastic job)"
        )


def _choose_backend(requested: Optional[str], mode: Mode) -> str:
    """``tpu_dist`` on a TPU slice, real or simulated (there torch_tpu's backend
    is stood in for by gloo, for device tensors only, `_compat.simulated_tpu`);
    an explicit other backend is the user's (e.g. ``gloo``: host tensors only)."""
    if requested in (None, "auto"):
        return "tpu_dist"
    if Mode(mode) is Mode.SIMULATE and requested not in ("tpu_dist", "gloo"):
        raise ValueError(
            f"TPUTorchConfig(backend={requested!r}) cannot run on a simulated slice (a simulated "
            f"'tpu' device, gloo underneath); leave backend=None (tpu_dist) or unset {C.RAY_TRAIN_TPU_SIMULATE}"
        )
    return requested


def _resolve_topology(reports, cfg: TorchConfig) -> Topology:
    host_values = {(r.accelerator_type, r.topology) for r in reports}
    if cfg.topology is not None:
        topology = Topology.parse(cfg.topology, cfg.accelerator_type)
        for pod_type, name in host_values:
            if name and Topology.parse(name, generation_of_pod_type(pod_type) or topology.accelerator_type).name != topology.name:
                raise ValueError(
                    f"TPUTorchConfig(topology={cfg.topology!r}) does not match the hosts' "
                    f"TPU_TOPOLOGY={name!r}; use the slice the cluster has"
                )
        return topology
    if len(host_values) != 1 or None in next(iter(host_values)):
        raise ValueError(
            "cannot tell the slice topology: the hosts report TPU_ACCELERATOR_TYPE/"
            f"TPU_TOPOLOGY {sorted(map(str, host_values))}; set them on every host or pass "
            "TPUTorchConfig(topology=..., accelerator_type=...)"
        )
    pod_type, name = next(iter(host_values))
    return Topology.parse(name, generation_of_pod_type(pod_type))


def _infos(reports: list[WorkerReport]) -> list:
    """`WorkerInfo` of each worker, with its host's TPU resources from ``ray.nodes()``."""
    node_tpus = {n["NodeID"]: n.get("Resources", {}).get("TPU", 0) for n in ray.nodes()}
    return [r.info(index=i, node_tpus=node_tpus.get(r.node_id, 0)) for i, r in enumerate(reports)]


def _layout(reports, topology: Topology, num_slices: int) -> Layout:
    placement = layout(_infos(reports), topology, num_slices)
    for warning in placement.warnings:
        logger.warning("ray_train_tpu: %s", warning)
    if placement.notes:
        logger.info("ray_train_tpu: %s", "; ".join(placement.notes))
    wrong = [i for i, rank in enumerate(placement.ranks) if rank != i]
    if wrong:
        raise RuntimeError(
            "ray_train_tpu: Ray ranked TPU workers differently from their hosts' "
            f"positions in the slice and chips (workers {wrong[:8]} would get ranks "
            f"{[placement.ranks[i] for i in wrong[:8]]}); the worker-order adapter is "
            f"tested with Ray {compat_ray.TESTED_RAY_VERSION}, found {ray.__version__}"
        )
    return placement


def _warn_env_changes(plans: list, extra: dict) -> None:
    """One warning per variable (not per worker): the host's value that was
    replaced or removed, the user's override kept, the rank override ignored."""
    for key in sorted(set(extra) & set(_RANK_KEYS)):
        logger.warning("ray_train_tpu: ignoring TPUTorchConfig(extra_env) %s: Ray fixes the ranks", key)
    seen: set = set()
    for rank, p in enumerate(plans):
        for key, (theirs, ours) in sorted(p.replaced.items()):
            if ("replaced", key) not in seen and key not in p.overridden:
                seen.add(("replaced", key))
                logger.warning(
                    "ray_train_tpu: replacing %s=%r that the host of rank %d carries with %r computed from the "
                    "live slice (stale or foreign; to force a value use TPUTorchConfig(extra_env))",
                    key, _short(theirs), rank, _short(ours),
                )
        for key in p.unset:
            if ("unset", key) not in seen:
                seen.add(("unset", key))
                logger.warning(
                    "ray_train_tpu: removing %s that the host of rank %d carries: this job does not use it",
                    key, rank,
                )
        for key, (value, ours) in sorted(p.overridden.items()):
            if ("override", key) not in seen:
                seen.add(("override", key))
                logger.warning(
                    "ray_train_tpu: TorchConfig(extra_env) sets %s=%r (computed %r)", key, _short(value), _short(ours)
                )


def _short(value: str, limit: int = 120) -> str:
    return value if len(value) <= limit else value[:limit] + f"... ({len(value)} chars)"


def _node_rank(rank: int, placement: Layout) -> int:
    per_host = len(placement.ranks) // len(placement.hosts)
    return rank // per_host
