"""``plan``: every worker's rank, host, chip and TorchTPU environment, without a cluster.

The plan is what `ray_train_tpu.launch_env` computes (the backend applies the
same values), shown as a table or JSON. It imports neither Ray nor torch.

Example:
    >>> from ray_train_tpu.topology import Topology
    >>> plan = build_plan(Topology.parse("2x2x2", "TPU-V4"), hosts=["10.0.0.1", "10.0.0.2"])
    >>> plan["num_workers"], plan["workers"][5]["host"], plan["workers"][5]["env"]["LOCAL_RANK"]
    (8, '10.0.0.2', '1')
    >>> plan["slices"][0]["env"]["TPU_WORKER_HOSTNAMES"], plan["env"]["MASTER_ADDR"]
    ('10.0.0.1,10.0.0.2', '10.0.0.1')
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
EXAMPLE = 'python -m ray_train_tpu plan --topology 2x2x2 --accelerator-type TPU-V4 --hosts 10.0.0.1,10.0.0.2 --format json'
HELP = "print every worker's rank, host, chip and TorchTPU env"


def register(subparsers, add_slice_args) -> None:
    p = subparsers.add_parser("plan", help=HELP)
    add_slice_args(p)
    p.add_argument("--hosts", help="comma-separated hosts in TPU worker id order, slice-major")
    p.add_argument("--format", choices=("json", "table"), default="table", help="table for people (default), json for tools")
    p.add_argument("--compact", action="store_true", help="JSON on one line")
    p.add_argument("--expand-env", action="store_true",
                   help="JSON: every worker's complete env (quadratic in the slice; by default values "
                        "shared by the job or a slice are given once)")
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
    expand_env: bool = False,
) -> dict:
    """The slice plan that ``python -m ray_train_tpu plan`` prints, as a dict.

    Its size is linear in the slice: a value shared by the whole job is in
    ``env``, one shared by a slice (its address list, its hostnames) in
    ``slices[i]["env"]``, and each worker's ``env`` has only its own values
    (ranks, chip). `worker_env` puts one worker's complete environment back
    together; ``expand_env=True`` gives every worker its complete environment
    (quadratic: every worker repeats its slice's address list). Without
    `hosts`, `placeholder_hosts` stand in for them and
    ``hosts_are_placeholders`` is True.
    """
    V.check_num_slices("", num_slices)
    V.check_job_size(topology, num_slices)
    placeholders = hosts is None
    if placeholders:
        hosts = placeholder_hosts(topology, num_slices)
    hosts = check_hosts(topology, hosts, num_slices)
    envs = launch_envs(
        topology,
        hosts,
        num_slices=num_slices,
        xprof_session_id=xprof_session_id,
        base_port=base_port,
        master_port=master_port,
        megascale_port=megascale_port,
    )
    per_slice = topology.num_devices
    job_env, slice_envs = _shared(envs, per_slice, num_slices)
    workers = []
    for p, env in envs:
        shared = {**job_env, **slice_envs[p.slice_id]}
        own = env if expand_env else {k: v for k, v in env.items() if k not in shared}
        workers.append({
            "rank": p.rank,
            "local_rank": p.local_rank,
            "node_rank": p.node_rank,
            "slice_id": p.slice_id,
            "worker_id": p.worker_id,
            "host": hosts[p.node_rank],
            "chip_coords": list(p.chip_coords),
            "env": own,
        })
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
        "hosts_are_placeholders": placeholders,
        "env_expanded": expand_env,
        "env": {} if expand_env else job_env,
        "slices": [
            {"slice_id": i, "hosts": hosts[i * topology.num_hosts:(i + 1) * topology.num_hosts],
             "env": {} if expand_env else slice_envs[i]}
            for i in range(num_slices)
        ],
        "workers": workers,
    }


_SLICE_KEYS = (C.TPU_WORKER_HOSTNAMES, C.TORCH_TPU_SLICEBUILDER_ADDRESSES, C.MEGASCALE_SLICE_ID)


def _shared(envs: list, per_slice: int, num_slices: int) -> tuple[dict, list[dict]]:
    """The values every worker of the job has, and those every worker of each slice has."""
    def common(group: list[dict]) -> dict:
        first = group[0]
        return {k: v for k, v in first.items() if all(e.get(k) == v for e in group[1:])}

    slice_envs = [common([env for _, env in envs[i * per_slice:(i + 1) * per_slice]]) for i in range(num_slices)]
    # A stable schema: what describes a slice stays with the slice even in a one-slice job.
    job_env = {k: v for k, v in slice_envs[0].items()
               if k not in _SLICE_KEYS and all(s.get(k) == v for s in slice_envs[1:])}
    slice_envs = [{k: v for k, v in s.items() if k not in job_env} for s in slice_envs]
    return job_env, slice_envs


def worker_env(plan: dict, rank: int) -> dict:
    """Worker `rank`'s complete environment, from a plan of either form.

    Example:
        >>> plan = build_plan(Topology.parse("2x2x2", "TPU-V4"), hosts=["10.0.0.1", "10.0.0.2"])
        >>> worker_env(plan, 5)["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[5]
        '10.0.0.2:8071'
    """
    w = plan["workers"][rank]
    return {**plan["env"], **plan["slices"][w["slice_id"]]["env"], **w["env"]}


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
        expand_env=args.expand_env,
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
    if plan["hosts_are_placeholders"]:
        lines.append("hosts are PLACEHOLDERS (pass --hosts for real addresses)")
    if workers:
        env0 = worker_env(plan, 0)
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
        env = worker_env(plan, w["rank"])
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        in_slice = w["rank"] - w["slice_id"] * (len(workers) // plan["num_slices"])
        coords = "(" + ",".join(str(c) for c in w["chip_coords"]) + ")"
        lines.append(
            f"{w['rank']:>5} {w['slice_id']:>5} {w['node_rank']:>5} {w['local_rank']:>5} "
            f"{env['TPU_VISIBLE_CHIPS']:>4}  {coords:<12} {addresses[in_slice]:<28} {w['host']}"
        )
    return "\n".join(lines) + "\n"
