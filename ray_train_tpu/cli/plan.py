"""``plan``: every worker's rank, host, chip and TorchTPU environment, without a cluster.

The plan is what `ray_train_tpu.launch_env` computes (the backend applies the
same values), shown as a table or JSON. It imports neither Ray nor torch.

Example:
    >>> from ray_train_tpu.topology import Topology
    >>> plan = build_plan(Topology.parse("2x2x2", "TPU-V4"), hosts=["10.0.0.1", "10.0.0.2"])
    >>> plan["num_workers"], plan["workers"][5]["host"], plan["workers"][5]["env"]["LOCAL_RANK"]
    (8, '10.0.0.2', '1')
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence, TextIO

from ray_train_tpu import constants as C
from ray_train_tpu import _validate as V
from ray_train_tpu.launch_env import check_hosts, launch_envs, placeholder_hosts
from ray_train_tpu.topology import Topology

ORDER = 0  # first in the help
HELP = "print every worker's rank, host, chip and TorchTPU env"


def register(subparsers, add_slice_args) -> None:
    p = subparsers.add_parser("plan", help=HELP)
    add_slice_args(p)
    p.add_argument("--hosts", help="comma-separated hosts in TPU worker id order, slice-major")
    p.add_argument("--format", choices=("json", "table"), default="table")
    p.add_argument("--compact", action="store_true", help="JSON on one line")
    p.add_argument("--base-port", type=int, default=C.DEFAULT_TORCH_TPU_BASE_PORT,
                   help=f"TORCH_TPU_BASE_PORT (default {C.DEFAULT_TORCH_TPU_BASE_PORT})")
    p.add_argument("--master-port", type=int, default=C.DEFAULT_MASTER_PORT,
                   help=f"MASTER_PORT (default {C.DEFAULT_MASTER_PORT})")
    p.add_argument("--xprof-session-id", default="0", help="TORCH_TPU_XPROF_SESSION_ID to show (default 0)")
    p.set_defaults(func=_plan)


def build_plan(
    topology: Topology,
    *,
    num_slices: int = 1,
    hosts: Sequence[str] | None = None,
    xprof_session_id: str = "0",
    base_port: int = C.DEFAULT_TORCH_TPU_BASE_PORT,
    master_port: int = C.DEFAULT_MASTER_PORT,
    megascale_port: int = C.DEFAULT_MEGASCALE_PORT,
) -> dict:
    """The slice plan that ``python -m ray_train_tpu plan`` prints, as a dict.

    Workers are in rank order; each carries its complete `launch_env`. Without
    `hosts`, `placeholder_hosts` stand in for them.
    """
    V.check_num_slices("", num_slices)
    if hosts is None:
        hosts = placeholder_hosts(topology, num_slices)
    check_hosts(topology, hosts, num_slices)
    envs = launch_envs(
        topology,
        hosts,
        num_slices=num_slices,
        xprof_session_id=xprof_session_id,
        base_port=base_port,
        master_port=master_port,
        megascale_port=megascale_port,
    )
    return {
        "accelerator_type": topology.accelerator_type,
        "topology": topology.name,
        "pod_type": topology.pod_type,
        "num_slices": num_slices,
        "num_hosts": topology.num_hosts,
        "chips_per_host": topology.chips_per_host,
        "devices_per_chip": topology.devices_per_chip,
        "num_workers": len(envs),
        "resources_per_worker": {"TPU": 1},
        "workers": [
            {
                "rank": p.rank,
                "local_rank": p.local_rank,
                "node_rank": p.node_rank,
                "slice_id": p.slice_id,
                "worker_id": p.worker_id,
                "host": hosts[p.node_rank],
                "chip_coords": list(p.chip_coords),
                "env": env,
            }
            for p, env in envs
        ],
    }


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
