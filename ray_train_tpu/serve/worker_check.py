"""The env/place check a vLLM worker on a TPU slice runs before its device
starts, in simulation and on TPUs alike (no vLLM imports here).

- `slice_worker_setup`: one worker of a slice engine (Serve replica, batch
  engine): called by `SliceWorkerProc` with what vLLM's Ray executor hands the
  worker (simulated or vllm-torchtpu's), see `slice_plan.slice_worker_env`.
- `check_chip_engine`: a one-chip engine that runs vLLM in its own Ray actor
  (the RL rollout engines): it must hold exactly one chip, on the host and
  slice it was placed for, and no job variable of a multi-host slice may reach
  torch_tpu (a one-chip world that inherits another job's slice-builder
  addresses would try to join that slice). Call it in the actor before vLLM is
  imported.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu.discovery import host_identity
from ray_train_tpu.launch_env import JOB_KEYS
from ray_train_tpu.serve.slice_plan import SlicePlan, slice_worker_env

logger = logging.getLogger(__name__)

# What this process's worker was given (one slice worker per process).
APPLIED: dict = {}


def _ray_chips() -> list:
    import ray

    return list(ray.get_runtime_context().get_accelerator_ids().get("TPU", []))


def _host_env() -> dict:
    """This process's variables, with the host's ``TPU_NAME`` and ``TPU_WORKER_ID``
    from Ray's node labels where GKE's are absent (a TPU VM started with ``ray
    start``; the variable wins where both are set: `discovery.host_identity`)."""
    import ray

    env = _environ.copy()
    if (env.get(C.TPU_NAME) and env.get(C.TPU_WORKER_ID)) or not ray.is_initialized():
        return env  # GKE's variables, or no Ray worker to ask
    identity = host_identity(env, dict(ray.get_runtime_context().get_node_labels() or {}))
    for key, value in ((C.TPU_NAME, identity.slice_name), (C.TPU_WORKER_ID, identity.worker_id)):
        if not env.get(key) and value is not None:
            env[key] = value
    return env


def slice_worker_setup(rank: int, local_rank: int, engine_env: Mapping[str, str],
                       simulated: Optional[bool] = None) -> dict:
    """For vLLM worker `rank` (`local_rank` on its host), whose engine's and
    executor's variables are `engine_env`: check it and return the variables to
    give it (empty on a TPU, where vllm-torchtpu's stand once checked; none
    without a slice plan in `engine_env`). Stale job variables are removed
    from this process. `simulated` defaults to this process's
    ``RAY_TRAIN_TPU_SIMULATE``."""
    text = engine_env.get(C.RAY_TRAIN_TPU_SERVE_SLICE)
    if not text:
        return {}
    plan = SlicePlan.from_json(text)
    if simulated is None:
        simulated = _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"
    env = slice_worker_env(plan, rank, local_rank=local_rank, chips=_ray_chips(), host_env=_host_env(),
                           engine_env=engine_env, simulated=simulated)
    _environ.unset(env.unset)
    APPLIED.clear()
    APPLIED.update(env.set)
    _, chip = plan.place(rank)
    logger.info("%s worker rank %d on %s (host %s, chip %d): place and environment checked",
                "SIMULATED TPU" if simulated else "TPU", rank, plan.slice_name,
                plan.hosts[rank // plan.parsed.devices_per_host], chip)
    return env.set


def check_chip_engine(*, slice_name: str, host: Optional[str] = None,
                      chips: Optional[Sequence] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Check a one-chip engine's actor (see the module doc) and remove the
    multi-host job variables its host carries from this process; returns the
    chip it holds. RuntimeError, naming what is wrong, otherwise. `chips`
    (Ray's TPU ids of the actor) and `env` (its environment) default to this
    process's; with `env` given, nothing is removed (a dry run).

    Example (in RolloutEngine.__init__, before vLLM is imported):
        >>> check_chip_engine(slice_name=reservation_slice_name)      # doctest: +SKIP
        3
    """
    chips = _ray_chips() if chips is None else list(chips)
    env_given, env = env, (_host_env() if env is None else dict(env))
    where = f"slice {env.get(C.TPU_NAME)!r} (TPU worker {env.get(C.TPU_WORKER_ID)})"
    if len(chips) != 1:
        raise RuntimeError(f"a one-chip engine holds TPU ids {chips} on {where}; give its actor {{'TPU': 1}}")
    if env.get(C.TPU_NAME) != slice_name:
        raise RuntimeError(f"a one-chip engine meant for slice {slice_name!r} runs on {where}")
    if host is not None:
        import ray

        here = ray.util.get_node_ip_address()
        if here != host:
            raise RuntimeError(f"a one-chip engine meant for host {host} of {slice_name!r} runs on {here}")
    stale = [k for k in JOB_KEYS if k in env and k not in (C.TPU_VISIBLE_CHIPS, C.TPU_WORKER_ID)]
    if env_given is None:
        _environ.unset(stale)
    if stale:
        logger.warning("one-chip engine on %s: removed job variables of a multi-host slice its host carried: %s",
                       slice_name, ", ".join(stale))
    return int(chips[0])
