"""``python -m ray_train_tpu <command>``: plan, demo, doctor, kuberay, serve, rl-demo.

Bad input is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable, Optional, Sequence, TextIO

from ray_train_tpu.launch_env import build_plan
from ray_train_tpu.topology import GENERATIONS, Topology


# Modules that add a subcommand: each has `register(subparsers, add_slice_args)`,
# which adds its parser and sets `func(args, out) -> exit status`. They must not
# import Ray or torch at module level, so that `plan` stays fast.
_COMMAND_MODULES: tuple[str, ...] = (
    "ray_train_tpu.kuberay", "ray_train_tpu.demo", "ray_train_tpu.doctor", "ray_train_tpu.serve.cli",
    "ray_train_tpu.rl.cli",
)


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit itself
        raise UsageError(message)


def _add_slice_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", required=True, help='slice mesh in chips, e.g. "4x4" or "2x2x2"')
    p.add_argument(
        "--accelerator-type",
        required=True,
        help=f"one of {', '.join(GENERATIONS)}",
    )
    p.add_argument("--num-slices", type=int, default=1, help="slices in the job (default 1)")


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    topology = Topology.parse(args.topology, args.accelerator_type)
    hosts = None
    if args.hosts is not None:
        hosts = [h.strip() for h in args.hosts.split(",")]
    plan = build_plan(
        topology,
        num_slices=args.num_slices,
        hosts=hosts,
        xprof_session_id=args.xprof_session_id,
        base_port=args.base_port,
        master_port=args.master_port,
    )
    if args.format == "json":
        json.dump(plan, out, separators=(",", ":") if args.compact else None, indent=None if args.compact else 1)
        out.write("\n")
    else:
        out.write(format_plan_table(plan))
    return 0


def format_plan_table(plan: dict, max_rows: int = 64) -> str:
    """A plan for people: a header and one row per worker."""
    lines = [
        f"{plan['num_slices']} x {plan['accelerator_type']} {plan['topology']} "
        f"({plan['pod_type']}): {plan['num_hosts']} host(s) per slice x "
        f"{plan['chips_per_host']} chip(s), {plan['num_workers']} workers, "
        f"resources_per_worker={plan['resources_per_worker']}",
    ]
    workers = plan["workers"]
    if workers:
        env0 = workers[0]["env"]
        lines.append(
            f"MASTER_ADDR={env0['MASTER_ADDR']}:{env0['MASTER_PORT']}  "
            f"TORCH_TPU_TOPOLOGY={env0['TORCH_TPU_TOPOLOGY']}"
        )
    header = f"{'rank':>5} {'slice':>5} {'node':>5} {'local':>5} {'chip':>4}  {'coords':<12} {'slice-builder address':<28} host"
    lines.append(header)
    shown = workers if len(workers) <= max_rows else workers[: max_rows // 2] + workers[-max_rows // 2 :]
    for i, w in enumerate(shown):
        if len(shown) < len(workers) and i == max_rows // 2:
            lines.append(f"{'...':>5} ({len(workers) - len(shown)} more workers)")
        env = w["env"]
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        in_slice = w["rank"] - w["slice_id"] * (len(workers) // plan["num_slices"])
        coords = "(" + ",".join(str(c) for c in w["chip_coords"]) + ")"
        lines.append(
            f"{w['rank']:>5} {w['slice_id']:>5} {w['node_rank']:>5} {w['local_rank']:>5} "
            f"{env['TPU_VISIBLE_CHIPS']:>4}  {coords:<12} {addresses[in_slice]:<28} {w['host']}"
        )
    return "\n".join(lines) + "\n"


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m ray_train_tpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="print every worker's rank, host, chip and TorchTPU env")
    _add_slice_args(p)
    p.add_argument("--hosts", help="comma-separated hosts in TPU worker id order, slice-major")
    p.add_argument("--format", choices=("json", "table"), default="table")
    p.add_argument("--compact", action="store_true", help="JSON on one line")
    p.add_argument("--base-port", type=int, default=8070, help="TORCH_TPU_BASE_PORT (default 8070)")
    p.add_argument("--master-port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    p.add_argument("--xprof-session-id", default="0", help="TORCH_TPU_XPROF_SESSION_ID to show (default 0)")
    p.set_defaults(func=_plan)

    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(sub, _add_slice_args)
    return parser


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        func: Callable[[argparse.Namespace, TextIO], int] = args.func
        return func(args, out)
    except (UsageError, ValueError, TypeError) as e:
        err.write(f"ray_train_tpu: error: {e}\n")
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
