"""Runs on each TPU host: what torch_tpu needs there (packages, a free libtpu lockfile, the ``TPU_*`` env).

Never imports torch or torch_tpu (that would initialise libtpu and take the chips).
"""

from __future__ import annotations

from typing import Iterable, Optional

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._host import lockfile_holder

# Testing knobs, honoured on simulated hosts only (RAY_TRAIN_TPU_SIMULATE=1),
# whose hosts share one /tmp and one Python environment:
# a path that stands in for /tmp/libtpu_lockfile on this host, and
# comma-separated packages (torch_tpu, libtpu) the check treats as absent.
SIMULATE_LIBTPU_LOCKFILE = C.RAY_TRAIN_TPU_SIMULATE_LIBTPU_LOCKFILE
SIMULATE_MISSING_MODULES = C.RAY_TRAIN_TPU_SIMULATE_MISSING_MODULES

# Packages a TPU host needs: import name -> distribution names that provide it.
PACKAGES = {"torch_tpu": ("torch-tpu", "torch_tpu"), "libtpu": ("libtpu", "libtpu-nightly")}
_PROBE_ENV = (C.TPU_NAME, C.TPU_WORKER_ID, C.TPU_ACCELERATOR_TYPE, C.TPU_TOPOLOGY, C.RAY_TPU_RESOURCE_PER_CHIP,
              # What a webhook, another launcher or an earlier job may have left on the host.
              C.TPU_WORKER_HOSTNAMES, C.TORCH_TPU_SLICEBUILDER_ADDRESSES, C.TORCH_TPU_TOPOLOGY,
              C.MEGASCALE_COORDINATOR_ADDRESS, C.MEGASCALE_NUM_SLICES, C.MEGASCALE_SLICE_ID)


def probe_host(lockfile: str = C.LIBTPU_LOCKFILE) -> dict:
    """What torch_tpu needs on this host: its packages, a free libtpu lockfile, the ``TPU_*`` env.

    Runs in a Ray task on each TPU host. It finds packages with
    ``importlib.util.find_spec`` and never imports torch or torch_tpu (that
    would initialise libtpu and take the chips).
    """
    import importlib.util

    hidden: set[str] = set()
    if _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1":
        lockfile = _environ.get(SIMULATE_LIBTPU_LOCKFILE) or lockfile
        hidden = {m.strip() for m in (_environ.get(SIMULATE_MISSING_MODULES) or "").split(",") if m.strip()}
    packages = {}
    for name, dists in PACKAGES.items():
        try:
            found = name not in hidden and importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        packages[name] = {"found": found, "version": _version(dists) if found else None}
    return {
        "packages": packages,
        "lockfile": lockfile,
        "lockfile_holder": lockfile_holder(lockfile),
        "env": _environ.snapshot(_PROBE_ENV),
    }


def _version(dists: Iterable[str]) -> Optional[str]:
    from importlib import metadata

    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
