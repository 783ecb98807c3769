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
TORCHTPU_VERSION = "0.29.0"
# vLLM's Ray executor hands these to its workers (beyond VLLM_* and HF_*).
SLICE_PLAN_ENV = "RAY_TRAIN_TPU_SERVE_SLICE"
VLLM_HOST_IP = "VLLM_HOST_IP"
VLLM_RAY_BUNDLE_INDICES = "VLLM_RAY_BUNDLE_INDICES"

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


# --- vllm-torchtpu: confine its Ray executor to the replica's slice -----------------
#
# vllm-torchtpu's RayDistributedExecutorV2 (vllm_torchtpu/executors/
# ray_distributed_executor_v2.py) places rank r in bundle VLLM_RAY_BUNDLE_INDICES[r]
# (which our callback sets in TPU worker id order), but builds the slice's host list
# (`_slice_host_layout`: slice-builder addresses ip:TORCH_TPU_BASE_PORT+chip,
# NODE_RANK, MASTER_ADDR) from every TPU node in ray.nodes(): with two slices in one
# cluster, two replicas would mix each other's hosts. Our general plugin makes it
# read the replica's own slice plan instead. Untested on real TPUs (see README).

TORCHTPU_EXECUTOR = "vllm_torchtpu.executors.ray_distributed_executor_v2"


def torchtpu_host_layout(plan_json: str) -> tuple[list[str], dict[str, int]]:
    """`_slice_host_layout`'s answer for the replica's slice: its hosts in TPU
    worker id order and the devices each holds."""
    from ray_train_tpu.serve.slice_plan import SlicePlan

    plan = SlicePlan.from_json(plan_json)
    per_host = plan.parsed.devices_per_host
    return list(plan.hosts), {ip: per_host for ip in plan.hosts}


def confine_torchtpu_executor(executor_cls) -> None:
    """Make `executor_cls._slice_host_layout` answer from the replica's slice
    plan (``RAY_TRAIN_TPU_SERVE_SLICE``) when there is one."""
    original = executor_cls._slice_host_layout
    if getattr(original, "_ray_train_tpu", False):
        return

    def _slice_host_layout(self, device_str):
        plan_json = _environ.get(SLICE_PLAN_ENV)
        if not plan_json:
            return original(self, device_str)
        return torchtpu_host_layout(plan_json)

    _slice_host_layout._ray_train_tpu = True
    executor_cls._slice_host_layout = _slice_host_layout


def vllm_general_plugin() -> None:
    """Entry point (``vllm.general_plugins``: ``ray_train_tpu``); vLLM loads it in
    every process. Only acts where vllm-torchtpu is installed."""
    if not _torchtpu_installed() or _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1":
        return
    import importlib

    confine_torchtpu_executor(importlib.import_module(TORCHTPU_EXECUTOR).RayDistributedExecutorV2)
