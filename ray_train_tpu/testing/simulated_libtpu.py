"""libtpu's answer to torch_tpu's chip-coordinate query, on a simulated host.

On a TPU host, torch_tpu's launcher asks libtpu where this host's chips sit in
the slice (``python -m torch_tpu._internal.distributed.distributed
--print_local_device_coords`` prints ``TORCH_TPU_LOCAL_DEVICE_COORDS=[x, y, z]``,
the coordinates of the process's first device). What libtpu can tell depends
on the environment the process starts with, and this module answers as
strictly, from the simulated host's chips (``RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS``,
set by `simulated_tpu_cluster`):

- ``TPU_VISIBLE_CHIPS`` selects the chips the process may use (all when unset);
  an index the host does not have is refused.
- The chips per process (``TPU_CHIPS_PER_PROCESS_BOUNDS``, else
  ``TPU_CHIPS_PER_HOST_BOUNDS``, else the whole host) must hold exactly the
  visible chips, or libtpu refuses to start.
- The processes of the slice (``TPU_PROCESS_BOUNDS``, else ``TPU_HOST_BOUNDS``,
  else one: there is no metadata server to ask) decide what the coordinates
  mean. One process: the visible chips are the whole slice, and the answer is
  the first chip's place among them, a local coordinate: Ray's one-chip
  bounds (``1,1,1`` / ``1,1,1``) give ``[0, 0, 0]`` on every chip of every host.
  Several processes: the answer is the chip's physical place in the slice, and
  a chip outside the mesh the bounds describe is refused.

Assumptions, untested on real TPUs (there are none where this was written):
that libtpu reports local coordinates for a single-process view and slice
coordinates for a multi-process one. Not simulated: a multi-host bring-up
waits for every host's process (the hosts run the query together), and a chip
held by another process's PJRT client is refused by libtpu's lock file.

Run as ``python -m ray_train_tpu.testing.simulated_libtpu``: prints the line
torch_tpu's child prints, or the refusal on stderr with exit status 1.

Example:
    >>> host = {"RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS": "0,0,1;1,0,1;0,1,1;1,1,1"}
    >>> local_device_coords({**host, "TPU_HOST_BOUNDS": "1,1,2", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"})
    [0, 0, 1]
    >>> local_device_coords({**host, "TPU_VISIBLE_CHIPS": "3", "TPU_HOST_BOUNDS": "1,1,1",
    ...                      "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1"})
    [0, 0, 0]
"""

from __future__ import annotations

import json
import sys
from typing import Mapping, Optional, Sequence

from ray_train_tpu import constants as C
from ray_train_tpu._compat.torch_tpu import COORDS_PREFIX

Chip = tuple[int, int, int]


class LibtpuRefusal(RuntimeError):
    """What libtpu would refuse to start with."""


def parse_chip_layout(raw: Optional[str]) -> list[Chip]:
    """``"x,y,z;x,y,z;..."`` -> the chips' coordinates, in chip-index order."""
    if not raw:
        return []
    chips = []
    for part in raw.split(";"):
        fields = part.split(",")
        if len(fields) != 3 or not all(f.strip().isdigit() for f in fields):
            raise ValueError(
                f"{C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS}={raw!r}: {part!r} is not 'x,y,z' "
                "(non-negative integers); chips are separated by ';'"
            )
        x, y, z = (int(f) for f in fields)
        chips.append((x, y, z))
    return chips


def _bounds(env: Mapping[str, str], names: Sequence[str]) -> Optional[tuple[str, tuple[int, ...]]]:
    """The first of `names` that is set: (name=value, its first three fields)."""
    for name in names:
        raw = env.get(name)
        if raw:
            try:
                fields = tuple(int(f) for f in raw.split(","))
            except ValueError:
                raise LibtpuRefusal(f"{name}={raw!r} is not comma-separated integers") from None
            if len(fields) not in (3, 4) or min(fields) < 1:
                raise LibtpuRefusal(f"{name}={raw!r} must be 3 positive integers (4 with cores per chip)")
            return f"{name}={raw}", fields[:3]
    return None


def _visible(env: Mapping[str, str], count: int) -> list[int]:
    raw = env.get(C.TPU_VISIBLE_CHIPS)
    if raw is None:
        return list(range(count))
    try:
        ids = [int(v) for v in raw.split(",") if v.strip()]
    except ValueError:
        raise LibtpuRefusal(f"{C.TPU_VISIBLE_CHIPS}={raw!r} is not comma-separated chip indices") from None
    bad = [i for i in ids if not 0 <= i < count]
    if not ids or bad:
        raise LibtpuRefusal(f"{C.TPU_VISIBLE_CHIPS}={raw!r}: this host has chips 0..{count - 1}")
    return ids


def _product(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def local_device_coords(env: Mapping[str, str]) -> list[int]:
    """Coordinates of the first visible chip, as libtpu reports them to a
    process started with `env` (see the module docstring); LibtpuRefusal
    where libtpu would refuse to start."""
    chips = parse_chip_layout(env.get(C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS))
    if not chips:
        raise LibtpuRefusal("no TPU chips on this host")
    visible = [chips[i] for i in _visible(env, len(chips))]
    per_process = _bounds(env, (C.TPU_CHIPS_PER_PROCESS_BOUNDS, C.TPU_CHIPS_PER_HOST_BOUNDS))
    if per_process is not None and _product(per_process[1]) != len(visible):
        raise LibtpuRefusal(
            f"{per_process[0]} is {_product(per_process[1])} chip(s) per process, but {len(visible)} are "
            f"visible ({C.TPU_VISIBLE_CHIPS}={env.get(C.TPU_VISIBLE_CHIPS)!r})"
        )
    processes = _bounds(env, (C.TPU_PROCESS_BOUNDS, C.TPU_HOST_BOUNDS))
    first = visible[0]
    if processes is None or _product(processes[1]) == 1:
        low = [min(c[d] for c in visible) for d in range(3)]
        return [first[d] - low[d] for d in range(3)]
    own = per_process[1] if per_process else tuple(max(c[d] for c in visible) - min(c[d] for c in visible) + 1
                                                   for d in range(3))
    mesh = [p * o for p, o in zip(processes[1], own)]
    if any(not 0 <= first[d] < mesh[d] for d in range(3)):
        raise LibtpuRefusal(f"chip {first} is outside the {mesh} mesh of {processes[0]}")
    return list(first)


def main(env: Mapping[str, str]) -> int:
    try:
        coords = local_device_coords(env)
    except (LibtpuRefusal, ValueError) as e:
        print(f"SIMULATED libtpu refuses to start: {e}", file=sys.stderr)
        return 1
    print(f"{COORDS_PREFIX}{json.dumps(coords)}")
    return 0


if __name__ == "__main__":
    from ray_train_tpu import _environ

    sys.exit(main(_environ.copy()))
