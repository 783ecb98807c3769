"""Every touch of torch_tpu's ``_internal`` package, pinned to `constants.TORCH_TPU_VERSION`.

- How many TPU chips this process can see, for diagnosis
  (``torch_tpu._internal.utils.hardware.get_tpu_device_count``).
- The physical chip coordinates of this host's TPU device, which order the
  hosts of a slice (`query_chip_coords`, torch_tpu's own child process).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

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


def coords_argv() -> list[str]:
    """torch_tpu's own coordinate child, as its ``_query_local_device_coords`` runs it."""
    return [sys.executable, "-m", COORDS_MODULE, COORDS_FLAG]


@dataclasses.dataclass(frozen=True)
class CoordsAnswer:
    """What one coordinate query found: the chip's (X, Y, Z), or why not."""

    coords: Optional[tuple[int, int, int]]
    error: Optional[str]  # None when `coords` were found
    seconds: float  # wall time of the query


def query_chip_coords(env: Mapping[str, str], timeout_s: float = C.DEFAULT_CHIP_COORDS_TIMEOUT_S,
                      argv: Optional[Sequence[str]] = None) -> CoordsAnswer:
    """Physical (X, Y, Z), in the slice's ICI mesh, of the first TPU device that
    a process started with `env` sees, from torch_tpu's own query.

    The call is torch_tpu's: torch-tpu 0.2.0,
    ``torch_tpu/_internal/distributed/distributed.py``, ``_query_local_device_coords``
    runs ``python -m torch_tpu._internal.distributed.distributed
    --print_local_device_coords`` (``_print_local_device_coords`` prints
    ``tpu_distributed.local_device_coords()`` after ``TORCH_TPU_LOCAL_DEVICE_COORDS=``).
    We run the same child (`argv`, default `coords_argv`), because the query
    starts a PJRT client, which claims the chips it sees: in the calling
    process, they would stay claimed. torch_tpu runs it once per host in its
    launcher, which sees the whole host; what libtpu answers depends on the
    `env` it starts with (`ray_train_tpu.launch_env.coords_query_env` gives
    the whole host's view). Without a TPU on this host (torch_tpu's PCI scan
    finds none) no child starts, unless `argv` names another program.

    Never raises: a failure, a timeout or output without the coordinates is
    an answer without coordinates that says why.
    """
    started = time.monotonic()

    def answer(coords=None, error=None) -> CoordsAnswer:
        return CoordsAnswer(coords=coords, error=error, seconds=time.monotonic() - started)

    if argv is None:
        if not tpu_chip_count():
            return answer(error="torch_tpu finds no TPU chip on this host")
        argv = coords_argv()
    env = dict(env)
    # as torch_tpu does: the child finds the packages this process found
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        done = subprocess.run(list(argv), capture_output=True, env=env, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return answer(error=f"torch_tpu's coordinate query timed out after {timeout_s:g} s")
    except OSError as e:
        return answer(error=f"torch_tpu's coordinate query could not start: {e}")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-500:]
        return answer(error=f"torch_tpu's coordinate query exited with status {done.returncode}: {tail}")
    coords = parse_coords_output(done.stdout)
    if coords is None:
        return answer(error=f"torch_tpu's coordinate query printed no {COORDS_PREFIX} line: {done.stdout[-500:]!r}")
    return answer(coords=coords)


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
