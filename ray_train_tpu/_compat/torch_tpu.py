"""Every touch of torch_tpu's ``_internal`` package, pinned to `constants.TORCH_TPU_VERSION`.

- How many TPU chips this process can see, for diagnosis
  (``torch_tpu._internal.utils.hardware.get_tpu_device_count``).
- The physical chip coordinates of this host's TPU device, which order the
  hosts of a slice (`local_chip_coords`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Optional

from ray_train_tpu import constants as C

logger = logging.getLogger(__name__)

TESTED_TORCH_TPU_VERSION = C.TORCH_TPU_VERSION

# torch-tpu 0.2.0, torch_tpu/_internal/distributed/distributed.py: the module,
# flag and stdout prefix of its ``_query_local_device_coords`` child process.
COORDS_MODULE = "torch_tpu._internal.distributed.distributed"
COORDS_FLAG = "--print_local_device_coords"
COORDS_PREFIX = "TORCH_TPU_LOCAL_DEVICE_COORDS="


def tpu_chip_count() -> Optional[int]:
    """Chips torch_tpu sees on this host, or None when it cannot tell (not
    installed, or its probe failed: diagnosis must never raise)."""
    try:
        from torch_tpu._internal.utils import hardware

        return hardware.get_tpu_device_count()
    except Exception:  # diagnosis only
        return None


def _coords_argv() -> list[str]:
    return [sys.executable, "-m", COORDS_MODULE, COORDS_FLAG]


def local_chip_coords(timeout_s: float = C.DEFAULT_CHIP_COORDS_TIMEOUT_S) -> Optional[tuple[int, int, int]]:
    """Physical (X, Y, Z) coordinates, in the slice's ICI mesh, of the TPU chip
    this process may use; None when there is no TPU or torch_tpu cannot tell.

    The call is torch_tpu's own: torch-tpu 0.2.0,
    ``torch_tpu/_internal/distributed/distributed.py``, ``_query_local_device_coords``
    runs ``python -m torch_tpu._internal.distributed.distributed
    --print_local_device_coords`` (``_print_local_device_coords``, which prints
    ``torch_tpu._internal.distributed.tpu_distributed.local_device_coords()``
    after ``TORCH_TPU_LOCAL_DEVICE_COORDS=``). We run the same child, because
    the query initialises the PJRT client and claims the chips: done in this
    process, the worker would hold them before its environment is complete.
    Its launcher turns the coordinates into ``NODE_RANK`` (chip // (2, 2, 1),
    hosts sorted Z-major); `ray_train_tpu.discovery.order_slice_hosts` does the same.

    Untested on real TPUs (there are none where this was written): whether
    libtpu reports slice-global coordinates in a Ray worker that sees one chip
    (``TPU_VISIBLE_CHIPS``) is unverified. Coordinates that do not place every
    host of a slice apart are refused by `order_slice_hosts`, which then keeps
    the TPU worker id order and says so. The parsing and every fallback are
    unit-tested with a fake child.
    """
    count = tpu_chip_count()
    if not count:
        return None
    env = dict(os.environ)
    # as torch_tpu does: the child finds the packages this process found
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        done = subprocess.run(_coords_argv(), capture_output=True, check=True, env=env, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("ray_train_tpu: could not query this host's TPU chip coordinates from torch_tpu: %s", e)
        return None
    coords = parse_coords_output(done.stdout)
    if coords is None:
        logger.warning(
            "ray_train_tpu: torch_tpu's coordinate query printed no %s line: %r", COORDS_PREFIX, done.stdout[-500:]
        )
    return coords


def parse_coords_output(stdout: str) -> Optional[tuple[int, int, int]]:
    """The (X, Y, Z) of the last ``TORCH_TPU_LOCAL_DEVICE_COORDS=[...]`` line
    (importing torch_tpu may print other lines first); fields beyond the third
    are dropped and missing ones are 0, as torch_tpu pads them. None when there
    is no such line or it is not a list of integers.

    Example:
        >>> parse_coords_output("noise\\nTORCH_TPU_LOCAL_DEVICE_COORDS=[2, 0, 3, 0]\\n")
        (2, 0, 3)
        >>> parse_coords_output("TORCH_TPU_LOCAL_DEVICE_COORDS=[1, 1]")
        (1, 1, 0)
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith(COORDS_PREFIX):
            try:
                values = json.loads(line[len(COORDS_PREFIX):])
                if not isinstance(values, list) or not values or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
                ):
                    return None
            except json.JSONDecodeError:
                return None
            padded = list(values[:3]) + [0] * (3 - len(values[:3]))
            return (padded[0], padded[1], padded[2])
    return None
