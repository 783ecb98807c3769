"""``doctor``: check a running Ray cluster's TPU slices and hosts (`ray_train_tpu.doctor`)."""

from __future__ import annotations

import argparse
import json
from typing import Callable, TextIO

from ray_train_tpu.doctor import DEFAULT_TIMEOUT_S, FORMATS, RAY_ADDRESS, format_report_table, run_doctor

ORDER = 30
EXAMPLE = 'python -m ray_train_tpu doctor --address 10.0.0.1:6379 --format json'


def _doctor(args: argparse.Namespace, out: TextIO) -> int:
    report = run_doctor(args.address, args.timeout)
    if args.format == "json":
        json.dump(report, out, indent=1)
        out.write("\n")
    else:
        out.write(format_report_table(report))
    return 0 if report["healthy"] else 1


def register(subparsers, add_slice_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``doctor`` to ``python -m ray_train_tpu``."""
    p = subparsers.add_parser("doctor", help="check a running Ray cluster's TPU slices and hosts; "
                              "exit 0 healthy, 1 problems, 2 cannot connect")
    p.add_argument("--address", help=f"Ray cluster: host:port of the GCS, ray://host:port, or auto "
                   f"(default ${RAY_ADDRESS}, else auto)")
    p.add_argument("--format", choices=FORMATS, default="table", help="table for people (default), json for tools")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for the hosts' checks (default {DEFAULT_TIMEOUT_S:g})")
    p.set_defaults(func=_doctor)
