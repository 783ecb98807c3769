"""Facts about this host that need no Ray and no torch: a free port, who holds libtpu's lockfile."""

from __future__ import annotations

import os
import socket
import sys
from typing import Optional


# Where free_port looks first: below the kernel's ephemeral range and above
# Ray's default worker ports (10002-19999).
_LISTEN_PORTS_FLOOR = 20000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (an address of this machine) right now.

    The caller binds it a moment later (a rendezvous store). A port from the
    kernel's ephemeral range can be taken in between by any outgoing connection,
    and Ray opens many (the suite saw EADDRINUSE); so a port below that range is
    tried first, and the kernel's choice only if none of those is free."""
    import random

    low = _ephemeral_low()
    if low - 1 > _LISTEN_PORTS_FLOOR:
        for port in random.sample(range(_LISTEN_PORTS_FLOOR, low), min(64, low - _LISTEN_PORTS_FLOOR)):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def lockfile_holder(path: str) -> Optional[dict]:
    """Who holds libtpu's lockfile at `path`: ``{"pid", "name"}`` (either may be
    None), or None when the file is absent or free. Never blocks (``LOCK_NB``)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pid = _lock_owner_pid(fd)
            return {"pid": pid, "name": _process_name(pid)}
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def describe_holder(holder: dict) -> str:
    """``process 4242 (python)``, or ``another process`` when the pid is unknown."""
    who = f"process {holder['pid']}" if holder.get("pid") else "another process"
    return who + (f" ({holder['name']})" if holder.get("name") else "")


def _lock_owner_pid(fd: int) -> Optional[int]:
    """The pid of a conflicting POSIX lock (F_GETLK), Linux only; 0 or None if unknown."""
    import fcntl
    import struct

    if not sys.platform.startswith("linux"):
        return None
    layout = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(layout, fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return None
    l_type, _, _, _, pid = struct.unpack(layout, answer)
    return pid if l_type != fcntl.F_UNLCK and pid > 0 else None  # 0: another PID namespace


def _process_name(pid: Optional[int]) -> Optional[str]:
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or None
    except OSError:
        return None
