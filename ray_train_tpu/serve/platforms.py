"""Which vLLM platform a process of ours runs on; our vLLM platform plugin.

vLLM picks its platform from plugins (entry point group
``vllm.platform_plugins``; one out-of-tree plugin that answers wins over the
built-in ones). This package registers `vllm_platform_plugin` (setup.cfg):

- ``RAY_TRAIN_TPU_SIMULATE=1`` (explicit simulation): the simulated TPU
  platform, vLLM's CPU platform on TPU bundles (`_vllm_sim`).
- vllm-torchtpu installed: nothing; its own plugin (``torchtpu``: device
  "tpu", backend "tpu_dist", ``ray_device_key="TPU"``) is the platform.
- a TPU host (libtpu installed, or a TPU device or TPU host variables) with
  neither: a platform whose import fails with a message that says what to
  install. Never vLLM's CPU platform, never its JAX TPU platform.
- anything else: nothing (vLLM decides as usual).

No vLLM import here: vLLM calls the plugin while it imports itself.
"""

from __future__ import annotations

import glob
import importlib.util
from importlib import metadata
from typing import Mapping, Optional

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

SIMULATED_PLATFORM = "ray_train_tpu.serve._vllm_sim.SimulatedTPUPlatform"
MISSING_PLATFORM = "ray_train_tpu.serve._no_tpu_platform.MissingTorchTPUPlatform"
TORCHTPU_DIST = "vllm-torchtpu"
TORCHTPU_VERSION = C.VLLM_TORCHTPU_VERSION
# vLLM's Ray executor hands these to its workers (beyond VLLM_* and HF_*).
SLICE_PLAN_ENV = C.RAY_TRAIN_TPU_SERVE_SLICE
VLLM_HOST_IP = C.VLLM_HOST_IP
VLLM_RAY_BUNDLE_INDICES = C.VLLM_RAY_BUNDLE_INDICES

INSTALL_HINT = (
    f"pip install {TORCHTPU_DIST}=={TORCHTPU_VERSION} vllm-torchtpu-core=={TORCHTPU_VERSION} "
    "(Python 3.12; README 'Serving')"
)


def tpu_host_evidence(env: Mapping[str, str], libtpu_installed: bool, accel_devices: list[str]) -> list[str]:
    """Why this process looks like it runs on a TPU host (empty: it does not)."""
    found = []
    if libtpu_installed:
        found.append("libtpu is installed")
    if accel_devices:
        found.append(f"TPU devices {', '.join(accel_devices[:2])}")
    for key in (C.TPU_ACCELERATOR_TYPE, C.TPU_WORKER_ID):
        if env.get(key):
            found.append(f"{key}={env[key]}")
    return found


def select_platform(env: Mapping[str, str], *, torchtpu_installed: bool, tpu_evidence: list[str]) -> Optional[str]:
    """The platform class our plugin names, or None to let vLLM decide."""
    if env.get(C.RAY_TRAIN_TPU_SIMULATE) == "1":
        return SIMULATED_PLATFORM
    if torchtpu_installed:
        return None
    if tpu_evidence:
        return MISSING_PLATFORM
    return None


def _torchtpu_installed() -> bool:
    try:
        metadata.version(TORCHTPU_DIST)
        return True
    except metadata.PackageNotFoundError:
        return False


def current_evidence() -> list[str]:
    return tpu_host_evidence(
        _environ.copy(),
        libtpu_installed=importlib.util.find_spec("libtpu") is not None,
        accel_devices=sorted(glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")),
    )


def vllm_platform_plugin() -> Optional[str]:
    """Entry point (``vllm.platform_plugins``: ``ray_train_tpu``)."""
    choice = select_platform(_environ.copy(), torchtpu_installed=_torchtpu_installed(),
                             tpu_evidence=current_evidence())
    if choice == SIMULATED_PLATFORM:
        _simulated_host_ip()
    return choice


def _simulated_host_ip() -> None:
    """Each simulated host is a raylet on its own loopback address, but vLLM
    finds "its" address through the default route, the same on every host:
    a vLLM worker (a Ray actor) is told its Ray node's address instead."""
    if _environ.get(VLLM_HOST_IP):
        return
    try:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            _environ.update({VLLM_HOST_IP: ray.util.get_node_ip_address()})
    except Exception:  # not in a Ray worker: vLLM decides
        pass


# --- every vLLM process: the worker check, and vllm-torchtpu confined to the slice ---


def torchtpu_host_layout(plan_json: str) -> tuple[list[str], dict[str, int]]:
    """What vllm-torchtpu's executor should take as the engine's slice (its
    ``_slice_host_layout``): the plan's hosts in TPU worker id order and the
    devices each holds."""
    from ray_train_tpu.serve.slice_plan import SlicePlan

    plan = SlicePlan.from_json(plan_json)
    per_host = plan.parsed.devices_per_host
    return list(plan.hosts), {ip: per_host for ip in plan.hosts}


def _engine_slice_layout():
    plan_json = _environ.get(SLICE_PLAN_ENV)
    return torchtpu_host_layout(plan_json) if plan_json else None


def vllm_general_plugin() -> None:
    """Entry point (``vllm.general_plugins``: ``ray_train_tpu``); vLLM loads it in
    every process. vLLM's Ray executors start every worker in `SliceWorkerProc`
    (the env/place check of a slice's workers, simulated or not); with
    vllm-torchtpu, its executor takes the engine's slice from the plan."""
    from ray_train_tpu._compat import vllm as V
    from ray_train_tpu.serve._worker_proc import SliceWorkerProc

    V.use_worker_proc(SliceWorkerProc)
    if not _torchtpu_installed() or _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1":
        return
    from ray_train_tpu._compat import vllm_torchtpu as T

    T.confine_executor(T.executor_class(), _engine_slice_layout)
