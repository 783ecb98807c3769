"""The doctor's report for people: slices, hosts, then problems."""

from __future__ import annotations

from typing import Mapping

from ray_train_tpu.doctor.checks import POD_TYPE_LABEL, TOPOLOGY_LABEL, WORKER_ID_LABEL
from ray_train_tpu.doctor.probe import PACKAGES

FORMATS = ("table", "json")


def format_report_table(report: Mapping) -> str:
    """The report for people: slices, hosts, then problems."""
    hosts, slices, problems = report["hosts"], report["slices"], report["problems"]
    lines = [f"Ray cluster {report.get('address') or ''}: {report['num_nodes']} node(s), "
             f"{len(hosts)} TPU host(s) in {len(slices)} slice(s)", ""]
    if slices:
        lines += _table(["slice", "accelerator", "topology", "pod type", "hosts", "worker ids"], [
            [s["name"], s["accelerator_type"], s["topology"], s["pod_type"],
             f"{s['num_hosts']}/{s['num_hosts_expected'] if s['num_hosts_expected'] is not None else '?'}",
             ",".join(map(str, s["worker_ids"]))] for s in slices]) + [""]
    if hosts:
        lines += _table(["host", "slice", "worker", "chips", "TPU", "head", "pod type", "topology",
                         "torch_tpu", "libtpu", "lockfile"], [_host_row(h) for h in hosts]) + [""]
    if problems:
        lines.append(f"{len(problems)} problem(s):")
        lines += [f"  {p['check']}: {p['message']}" for p in problems]
    else:
        lines.append("healthy: no problems found")
    return "\n".join(lines) + "\n"


def _host_row(host: Mapping) -> list:
    labels, probe = host["labels"], host.get("probe")
    row = [host["ip"], host["slice"], labels.get(WORKER_ID_LABEL), host["chips"], host["tpu_resources"],
           "yes" if host["head_resources"] else "-", labels.get(POD_TYPE_LABEL), labels.get(TOPOLOGY_LABEL)]
    if probe is None or "error" in probe:
        status = "timeout" if probe and probe.get("timed_out") else ("failed" if probe else "not checked")
        return row + [status, status, status]
    for name in PACKAGES:
        found = probe["packages"][name]
        row.append((found["version"] or "found") if found["found"] else "MISSING")
    holder = probe.get("lockfile_holder")
    row.append("free" if holder is None else f"HELD by {holder.get('pid') or '?'}")
    return row


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [[str(c) if c is not None else "-" for c in row] for row in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
