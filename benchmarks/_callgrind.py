"""Load-insensitive per-step cost: instructions counted by valgrind's callgrind on one rank.

This machine's VM exposes no hardware counters (``perf stat -e instructions`` says
"not supported"), and wall or CPU time on a shared 2-core machine moves with the
load. Callgrind counts the instructions a process executes, whatever else runs.

How one rank is counted, the same way under every launcher:

- the rank's process is started as ``valgrind --tool=callgrind --instr-atstart=no
  python ...`` by a small shell wrapper (`write_wrapper`): torchrun runs it with
  ``--no-python`` and it picks ``RANK=0``; Ray Train workers get it as their
  ``py_executable`` (``RunConfig(worker_runtime_env=...)``) and the first worker
  to start claims it (a ``mkdir``), the others run plain Python;
- start-up runs uninstrumented; the training loop turns instrumentation on after
  its warm-up (`Marker.start`: zero, start) and dumps after the counted steps
  (`Marker.stop`), through callgrind's client requests compiled into a tiny
  shared library (valgrind/callgrind.h; no-ops outside valgrind);
- `read_counts` reads ``Ir`` (instructions) of that dump and `by_library`
  and `top_functions` say where they went. Two scopes (`THREAD_SCOPES`):
  ``all`` counts every thread of the rank together (the training thread, gloo's
  transport thread, and the launcher's own: Ray's core worker and gRPC threads,
  which do work per second, not per step, so under valgrind's ~50x slow-down
  their share is ~50x what it is in a real run); ``training`` counts the thread
  that runs the steps alone (``--separate-threads=yes``: a client-request dump
  then holds the calling thread only). all - training = every other thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

ENV_FLAG = "RTT_CALLGRIND"  # "1" in the one process that runs under callgrind
DUMP_PREFIX = "rtt_steps"

_C_SOURCE = r"""
#include <valgrind/callgrind.h>
int rtt_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
void rtt_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void rtt_stop(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def available() -> Optional[str]:
    """None if callgrind mode can run here, else what is missing."""
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} not found on PATH"
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        return "valgrind/callgrind.h not found (Debian: apt-get install valgrind)"
    return None


def _library() -> Path:
    digest = hashlib.sha1(_C_SOURCE.encode()).hexdigest()[:12]
    lib = Path(tempfile.gettempdir()) / f"rtt_callgrind_{digest}.so"
    if not lib.exists():
        src = lib.with_suffix(".c")
        src.write_text(_C_SOURCE)
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
        os.replace(tmp, lib)  # atomic: concurrent ranks never load a half-written file
    return lib


class Marker:
    """Start and stop counting around the measured steps, in the counted process."""

    def __init__(self):
        self._lib = ctypes.CDLL(str(_library()))
        self._lib.rtt_stop.argtypes = [ctypes.c_char_p]
        if not self._lib.rtt_on_valgrind():
            raise RuntimeError(f"{ENV_FLAG}=1 but this process is not running under valgrind")

    @classmethod
    def from_env(cls, environ=None) -> Optional["Marker"]:
        # Not a default of os.environ: this module is pickled by value to Ray
        # workers, and a default would carry the driver's environment along.
        environ = os.environ if environ is None else environ
        return cls() if environ.get(ENV_FLAG) == "1" else None

    def start(self) -> None:
        self._lib.rtt_start()

    def stop(self, label: str) -> None:
        self._lib.rtt_stop(f"{DUMP_PREFIX}:{label}".encode())


THREAD_SCOPES = ("all", "training")


def valgrind_command(out_dir: str, threads: str = "all") -> list[str]:
    """valgrind's command line; `threads`: ``"all"`` (one profile for every thread)
    or ``"training"`` (one per thread: the steps' dump holds the calling thread only)."""
    if threads not in THREAD_SCOPES:
        raise ValueError(f"threads={threads!r}: choose from {THREAD_SCOPES}")
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--separate-threads={'yes' if threads == 'training' else 'no'}",
            f"--callgrind-out-file={out_dir}/callgrind.out.%p", "--error-limit=no", "-q"]


def write_wrapper(path: Path, python: str, out_dir: str, *, rank_env: Optional[str], threads: str = "all") -> Path:
    """A ``python`` stand-in that runs one process under callgrind.

    `rank_env`: the variable naming the rank (torchrun: ``RANK``), whose value 0 is
    counted; None: the first process to start is counted (Ray workers learn their
    rank only after they start)."""
    vg = " ".join(valgrind_command(out_dir, threads))
    if rank_env:
        claim = f'[ "${{{rank_env}:-}}" = 0 ]'
    else:
        claim = f'mkdir "{out_dir}/claimed" 2>/dev/null'
    path.write_text(
        "#!/bin/sh\n"
        f"if {claim}; then\n"
        f"  export {ENV_FLAG}=1\n"
        f'  exec {vg} "{python}" "$@"\n'
        "fi\n"
        f'exec "{python}" "$@"\n'
    )
    path.chmod(0o755)
    return path


_HEADER = re.compile(r"^(desc|thread|totals|summary|events|pid):\s*(.*)$")


def parse_dump(text: str) -> dict:
    """The header fields of one callgrind dump file that `read_counts` needs."""
    out: dict = {}
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            key, value = m.groups()
            if key == "desc":
                out.setdefault("desc", []).append(value)
            else:
                out[key] = value.strip()
    return out


def _header(path: Path) -> str:
    """The dump's header: everything before its first cost line (the ``cmd:`` line
    of a Ray worker alone can be several kB)."""
    lines = []
    with open(path, errors="replace") as fh:
        for line in fh:
            if line.startswith(("fl=", "fn=", "ob=")):
                break
            lines.append(line)
    return "".join(lines)


def find_dump(out_dir: str, label: str) -> Path:
    """The dump of the counted steps (named `label` by `Marker.stop`)."""
    want = f"{DUMP_PREFIX}:{label}"
    for f in sorted(Path(out_dir).glob("callgrind.out.*")):
        if any(want in d for d in parse_dump(_header(f)).get("desc", [])):
            return f
    raise RuntimeError(f"no callgrind dump named {want!r} under {out_dir}")


def read_counts(path: Path) -> dict:
    """Instructions (``Ir``) in one dump, and its thread (None: every thread)."""
    info = parse_dump(_header(path) + "\n" + _tail(path))
    events = info.get("events", "Ir").split()
    total = info.get("totals") or info.get("summary")
    if total is None:
        raise RuntimeError(f"{path}: no totals line")
    thread = info.get("thread")
    return {"pid": info.get("pid"), "thread": int(thread) if thread else None,
            "instructions": int(total.split()[events.index("Ir")])}


def by_library(path: Path, n: int = 10) -> dict:
    """Instructions per library (self cost), the `n` largest, in one dump."""
    out: dict = {}
    for row in top_functions(path, n=None):
        out[row["object"]] = out.get(row["object"], 0) + row["instructions"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:n])


_ANNOTATED = re.compile(r"^\s*([\d,]+)\s+\(\s*([\d.]+)%\)\s+(\S.*)$")


def top_functions(path: Path, n: Optional[int] = 25, inclusive: bool = False) -> list[dict]:
    """The `n` functions (None: all) with the most instructions in a dump (self
    cost, or `inclusive` of callees), from ``callgrind_annotate``, each with the
    library (``object``) it is in."""
    cmd = ["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}", f"--threshold=100", str(path)]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    merged: dict = {}
    for line in text.splitlines():
        m = _ANNOTATED.match(line)
        if m and not m.group(3).startswith("PROGRAM TOTALS"):
            name = m.group(3).strip()
            if _JIT.match(name):  # oneDNN/MKL kernels generated at run time: addresses differ per run
                name, obj = "(run-time generated code, no symbol)", "(run-time generated code)"
            else:
                found = _OBJECT.search(name)
                obj = found.group(1).rsplit("/", 1)[-1] if found else "?"
            row = merged.setdefault(name[:200], {"instructions": 0, "percent": 0.0, "function": name[:200],
                                                 "object": obj})
            row["instructions"] += int(m.group(1).replace(",", ""))
            row["percent"] = round(row["percent"] + float(m.group(2)), 2)
    return sorted(merged.values(), key=lambda r: -r["instructions"])[:n]


_JIT = re.compile(r"^\?\?\?:0x[0-9a-f]+ \[\?\?\?\]$")
_OBJECT = re.compile(r"\[([^\]]+)\]\s*$")


def _tail(path: Path, size: int = 4096) -> str:
    with open(path, "rb") as fh:
        fh.seek(max(0, path.stat().st_size - size))
        return fh.read().decode(errors="replace")
