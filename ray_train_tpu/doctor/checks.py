"""Pure: ``ray.nodes()`` and the hosts' probe answers -> the doctor's report. No Ray, no I/O."""

from __future__ import annotations

import collections
from typing import Iterable, Mapping, Optional

from ray_train_tpu import constants as C
from ray_train_tpu._host import describe_holder
from ray_train_tpu.doctor.probe import PACKAGES
from ray_train_tpu.topology import Generation, Topology, get_generation, normalize_pod_type

# Node labels Ray sets on TPU hosts (ray._raylet.RAY_NODE_TPU_*_KEY).
SLICE_LABEL = C.LABEL_TPU_SLICE_NAME
WORKER_ID_LABEL = C.LABEL_TPU_WORKER_ID
POD_TYPE_LABEL = C.LABEL_TPU_POD_TYPE
TOPOLOGY_LABEL = C.LABEL_TPU_TOPOLOGY
ACCELERATOR_LABEL = C.LABEL_ACCELERATOR_TYPE
TPU_LABELS = (SLICE_LABEL, WORKER_ID_LABEL, POD_TYPE_LABEL, TOPOLOGY_LABEL, ACCELERATOR_LABEL)


def tpu_hosts(nodes: Iterable[Mapping]) -> list[dict]:
    """The alive TPU hosts among ``ray.nodes()``, sorted by slice, worker id and IP."""
    hosts = []
    for node in nodes:
        if not node.get("Alive", node.get("alive", False)):
            continue
        labels = node.get("Labels") or {}
        resources = node.get("Resources") or {}
        tpu = resources.get("TPU", 0) or 0
        if tpu <= 0 and not any(k.startswith("ray.io/tpu-") for k in labels):
            continue
        raw_id = labels.get(WORKER_ID_LABEL)
        hosts.append({
            "node_id": node.get("NodeID"),
            "ip": node.get("NodeManagerAddress"),
            "slice": labels.get(SLICE_LABEL),
            "worker_id": int(raw_id) if raw_id is not None and raw_id.isdecimal() else None,
            "tpu_resources": _number(tpu),
            "head_resources": sorted(r for r in resources if r.startswith("TPU-") and r.endswith("-head")),
            "labels": {k: labels[k] for k in TPU_LABELS if k in labels},
        })
    hosts.sort(key=lambda h: (h["slice"] or "", h["worker_id"] if h["worker_id"] is not None else 1 << 30,
                              h["ip"] or ""))
    return hosts


def diagnose(nodes: Iterable[Mapping], probes: Optional[Mapping[str, Mapping]] = None) -> dict:
    """The doctor's report for ``ray.nodes()`` and the probes' answers by node id.

    A probe answer is `probe_host`'s dict, or ``{"error": str, "timed_out": bool}``.
    Hosts without an answer get no host checks. Returns ``{"healthy", "num_nodes",
    "slices", "hosts", "problems"}``; every problem has ``check`` and ``message``.
    """
    nodes = list(nodes)
    probes = probes or {}
    hosts = tpu_hosts(nodes)
    problems: list[dict] = []
    if not hosts:
        problems.append(_problem("no_tpu_hosts", "no alive Ray node has a TPU resource or a ray.io/tpu-* label"))
    for host in hosts:
        probe = probes.get(host["node_id"])
        host["probe"] = dict(probe) if probe is not None else None
        host["chips"] = _chips(host)
        problems += check_host(host)
    slices = []
    by_slice: dict[str, list[dict]] = collections.defaultdict(list)
    for host in hosts:
        if host["slice"] is not None:
            by_slice[host["slice"]].append(host)
    cluster_ips = frozenset(n.get("NodeManagerAddress") for n in nodes)
    for name in sorted(by_slice):
        summary, found = check_slice(name, by_slice[name], cluster_ips)
        slices.append(summary)
        problems += found
    problems += check_versions(hosts)
    alive = sum(1 for n in nodes if n.get("Alive", n.get("alive", False)))
    return {"healthy": not problems, "num_nodes": alive, "slices": slices, "hosts": hosts, "problems": problems}


def _problem(check: str, message: str, *, slice_name: Optional[str] = None, host: Optional[Mapping] = None) -> dict:
    out = {"check": check, "slice": slice_name, "ip": None, "node_id": None, "message": message}
    if host is not None:
        out.update(ip=host["ip"], node_id=host["node_id"], slice=slice_name or host["slice"])
    return out


def _number(x: float):
    return int(x) if float(x).is_integer() else x


def _generation(host: Mapping) -> Optional[Generation]:
    try:
        return get_generation(host["labels"].get(ACCELERATOR_LABEL, ""))
    except ValueError:
        return None


def _probe_ok(host: Mapping) -> Optional[Mapping]:
    probe = host.get("probe")
    return probe if probe is not None and "error" not in probe else None


def _resource_per_chip(host: Mapping) -> int:
    """Ray's TPU resources per chip on this host: as the host says, else as it should be."""
    probe = _probe_ok(host)
    if probe is not None:
        value = probe["env"].get(C.RAY_TPU_RESOURCE_PER_CHIP)
        return int(value) if value and value.isdecimal() and int(value) > 0 else 1
    gen = _generation(host)
    return gen.devices_per_chip if gen else 1


def _chips(host: Mapping):
    return _number(host["tpu_resources"] / _resource_per_chip(host))


def _name(host: Mapping) -> str:
    return f"host {host['ip']}" + (f" (worker {host['worker_id']})" if host["worker_id"] is not None else "")


def check_host(host: Mapping) -> list[dict]:
    """Problems of one TPU host: its labels, and what its probe found."""
    out = []
    missing = [k for k in TPU_LABELS if k not in host["labels"]]
    if missing:
        out.append(_problem("missing_label", f"{_name(host)} has TPU resources but no {', '.join(missing)} "
                            "label; Ray derives them from TPU_NAME, TPU_WORKER_ID, TPU_ACCELERATOR_TYPE and "
                            "TPU_TOPOLOGY (or the GCE metadata server)", host=host))
    raw_id = host["labels"].get(WORKER_ID_LABEL)
    if raw_id is not None and host["worker_id"] is None:
        out.append(_problem("bad_worker_id", f"{_name(host)} has {WORKER_ID_LABEL}={raw_id!r}; "
                            "expected an integer 0..hosts-1", host=host))
    probe = host.get("probe")
    if probe is None:
        return out
    if "error" in probe:
        check = "host_check_timeout" if probe.get("timed_out") else "host_check_failed"
        return out + [_problem(check, f"{_name(host)}: the check {probe['error']}", host=host)]
    for name, found in probe["packages"].items():
        if not found["found"]:
            out.append(_problem(f"{name}_missing", f"{_name(host)}: the Python that Ray runs cannot find "
                                f"{name}; install it on every TPU host", host=host))
    holder = probe.get("lockfile_holder")
    if holder is not None:
        who = describe_holder(holder)
        out.append(_problem("lockfile_held", f"{_name(host)}: libtpu's lockfile {probe['lockfile']} is held by "
                            f"{who}, so torch_tpu cannot open the chips; stop that process", host=host))
    out += _check_resource_per_chip(host, probe)
    out += _check_env_labels(host, probe)
    return out


def _check_resource_per_chip(host: Mapping, probe: Mapping) -> list[dict]:
    gen = _generation(host)
    if gen is None:
        return []
    value = probe["env"].get(C.RAY_TPU_RESOURCE_PER_CHIP)
    if (value or "1") == str(gen.devices_per_chip):
        return []
    want = f"{C.RAY_TPU_RESOURCE_PER_CHIP}={gen.devices_per_chip}" if gen.devices_per_chip > 1 else \
        f"{C.RAY_TPU_RESOURCE_PER_CHIP} unset (or 1)"
    return [_problem("resource_per_chip", f"{_name(host)}: {C.RAY_TPU_RESOURCE_PER_CHIP}="
                     f"{value if value is not None else '(unset)'}, but a {gen.accelerator_type} chip is "
                     f"{gen.devices_per_chip} TorchTPU device(s), one Ray Train worker each; start Ray with "
                     f"{want}", host=host)]


def _check_env_labels(host: Mapping, probe: Mapping) -> list[dict]:
    env, labels = probe["env"], host["labels"]
    pairs = [(C.TPU_NAME, SLICE_LABEL, env.get(C.TPU_NAME)),
             (C.TPU_WORKER_ID, WORKER_ID_LABEL, env.get(C.TPU_WORKER_ID)),
             (C.TPU_TOPOLOGY, TOPOLOGY_LABEL, (env.get(C.TPU_TOPOLOGY) or "").strip().lower() or None),
             # Ray's pod type is TPU_ACCELERATOR_TYPE without a "tpu-" prefix, lower case.
             (C.TPU_ACCELERATOR_TYPE, POD_TYPE_LABEL,
              normalize_pod_type(env.get(C.TPU_ACCELERATOR_TYPE) or "") or None)]
    diffs = [f"{var}={env.get(var)!r} but {label}={labels[label]!r}"
             for var, label, value in pairs if value is not None and label in labels and labels[label] != value]
    if not diffs:
        return []
    return [_problem("env_label_mismatch", f"{_name(host)}: {'; '.join(diffs)}; a label set by hand "
                     "overrides what Ray derives from the host, fix one or the other", host=host)]


def check_slice(name: str, hosts: list[dict], cluster_ips=frozenset()) -> tuple[dict, list[dict]]:
    """A slice's summary and problems: labels that agree, a valid topology, all of its hosts."""
    out = []
    agreed = {}
    for label in (ACCELERATOR_LABEL, TOPOLOGY_LABEL, POD_TYPE_LABEL):
        values = collections.Counter(h["labels"][label] for h in hosts if label in h["labels"])
        agreed[label] = values.most_common(1)[0][0] if values else None
        if len(values) > 1:
            detail = ", ".join(f"{h['ip']}: {h['labels'].get(label)}" for h in hosts)
            out.append(_problem("inconsistent_labels", f"slice {name}: hosts disagree on {label} ({detail})",
                                slice_name=name))
    accel, topo_label, pod_type = agreed[ACCELERATOR_LABEL], agreed[TOPOLOGY_LABEL], agreed[POD_TYPE_LABEL]
    topology = None
    if accel and topo_label:
        try:
            topology = Topology.parse(topo_label, accel)
        except ValueError as e:
            out.append(_problem("bad_topology", f"slice {name}: {TOPOLOGY_LABEL}: {e}", slice_name=name))
    ids = sorted(h["worker_id"] for h in hosts if h["worker_id"] is not None)
    summary = {"name": name, "accelerator_type": accel, "topology": topo_label, "pod_type": pod_type,
               "num_hosts": len(hosts), "num_hosts_expected": topology.num_hosts if topology else None,
               "worker_ids": ids, "hosts": [h["ip"] for h in hosts]}
    if topology is not None and pod_type and pod_type != topology.pod_type:
        out.append(_problem("pod_type_mismatch", f"slice {name}: {POD_TYPE_LABEL}={pod_type}, but {accel} "
                            f"{topology.name} is {topology.pod_type}", slice_name=name))
    out += _check_worker_ids(name, hosts, topology)
    head = f"TPU-{topology.pod_type if topology else pod_type}-head"
    out += _check_head(name, hosts, head) if (topology or pod_type) else []
    out += _check_chips(name, hosts, topology)
    out += _check_job_env(name, hosts, topology, cluster_ips)
    return summary, out


def _check_job_env(name: str, hosts: list[dict], topology: Optional[Topology], cluster_ips=frozenset()) -> list[dict]:
    """Job variables a host carries that cannot describe its slice (a webhook's for
    another slice, a JAX-style launcher's, an earlier job's). TPUTorchConfig replaces
    them at fit(); torch_tpu's own launcher and JAX would use them."""
    if topology is None:
        return []
    out = []
    for host in hosts:
        env = (_probe_ok(host) or {}).get("env", {})
        wrong = []
        names = env.get(C.TPU_WORKER_HOSTNAMES)
        if names is not None and len(names.split(",")) != topology.num_hosts:
            wrong.append(f"{C.TPU_WORKER_HOSTNAMES} lists {len(names.split(','))} host(s), the slice has "
                         f"{topology.num_hosts}")
        addresses = env.get(C.TORCH_TPU_SLICEBUILDER_ADDRESSES)
        if addresses is not None and len(addresses.split(",")) != topology.num_devices:
            wrong.append(f"{C.TORCH_TPU_SLICEBUILDER_ADDRESSES} has {len(addresses.split(','))} address(es), the "
                         f"slice has {topology.num_devices} device(s)")
        mesh = env.get(C.TORCH_TPU_TOPOLOGY)
        if mesh is not None and _mesh_chips(mesh) != topology.num_chips:
            wrong.append(f"{C.TORCH_TPU_TOPOLOGY}={mesh!r} is not a {topology.num_chips}-chip slice")
        coordinator = env.get(C.MEGASCALE_COORDINATOR_ADDRESS)
        if coordinator is not None and coordinator.rpartition(":")[0] not in cluster_ips:
            wrong.append(f"{C.MEGASCALE_COORDINATOR_ADDRESS}={coordinator!r} is on no node of this cluster")
        if wrong:
            out.append(_problem("stale_job_env", f"slice {name}: {_name(host)}: {'; '.join(wrong)}. TPUTorchConfig "
                                "replaces these at fit(); other launchers would use them: remove them from the "
                                "host's environment", host=host))
    return out


def _mesh_chips(mesh: str) -> Optional[int]:
    try:
        bounds = [int(b) for b in mesh.replace("x", ",").split(",")][:3]
    except ValueError:
        return None
    chips = 1
    for b in bounds:
        chips *= b
    return chips if bounds else None


def _check_worker_ids(name: str, hosts: list[dict], topology: Optional[Topology]) -> list[dict]:
    out = []
    counts = collections.Counter(h["worker_id"] for h in hosts if h["worker_id"] is not None)
    for wid, n in sorted(counts.items()):
        if n > 1:
            ips = ", ".join(h["ip"] for h in hosts if h["worker_id"] == wid)
            out.append(_problem("duplicate_worker_id", f"slice {name}: {n} hosts say they are TPU worker {wid} "
                                f"({ips}); each host of a slice needs its own TPU_WORKER_ID", slice_name=name))
    if topology is None:
        return out
    expected = range(topology.num_hosts)
    for host in hosts:
        if host["worker_id"] is not None and host["worker_id"] not in expected:
            out.append(_problem("unexpected_worker_id", f"slice {name}: {_name(host)} is outside the "
                                f"{topology.num_hosts} host(s) of {topology.pod_type} (worker ids 0.."
                                f"{topology.num_hosts - 1})", host=host))
    missing = [w for w in expected if w not in counts]
    if missing:
        out.append(_problem("missing_host", f"slice {name}: {topology.accelerator_type} {topology.name} "
                            f"({topology.pod_type}) has {topology.num_hosts} host(s), but TPU worker id(s) "
                            f"{', '.join(map(str, missing))} are not in the cluster; a slice is usable only whole",
                            slice_name=name))
    return out


def _check_head(name: str, hosts: list[dict], head: str) -> list[dict]:
    out = []
    zeros = [h for h in hosts if h["worker_id"] == 0]
    if zeros and not any(head in h["head_resources"] for h in zeros):
        have = sorted({r for h in zeros for r in h["head_resources"]})
        out.append(_problem("missing_head_resource", f"slice {name}: worker 0 ({', '.join(h['ip'] for h in zeros)})"
                            f" has no {head} resource" + (f" (has {', '.join(have)})" if have else "") +
                            "; Ray reserves a slice through it, and adds it on the host whose TPU_WORKER_ID is 0",
                            slice_name=name))
    for host in hosts:
        if host["worker_id"] != 0 and host["head_resources"]:
            out.append(_problem("misplaced_head_resource", f"slice {name}: {_name(host)} has "
                                f"{', '.join(host['head_resources'])}; only worker 0 should", host=host))
    return out


def _check_chips(name: str, hosts: list[dict], topology: Optional[Topology]) -> list[dict]:
    out = []
    counts = collections.Counter(h["chips"] for h in hosts)
    if len(counts) > 1:
        detail = ", ".join(f"{h['ip']}: {h['chips']}" for h in hosts)
        out.append(_problem("chip_count_mismatch", f"slice {name}: hosts have different chip counts ({detail})",
                            slice_name=name))
    if topology is None:
        return out
    for host in hosts:
        if host["chips"] != topology.chips_per_host:
            out.append(_problem("topology_chips_mismatch", f"slice {name}: {TOPOLOGY_LABEL}={topology.name} is "
                                f"{topology.num_hosts} host(s) x {topology.chips_per_host} chips, but "
                                f"{_name(host)} has {host['chips']} chip(s) ({host['tpu_resources']} TPU "
                                f"resources / {_resource_per_chip(host)} per chip)", host=host))
    return out


def check_versions(hosts: list[dict]) -> list[dict]:
    """All TPU hosts should run the same torch_tpu and libtpu."""
    out = []
    for name in PACKAGES:
        versions = collections.defaultdict(list)
        for host in hosts:
            probe = _probe_ok(host)
            found = probe["packages"].get(name) if probe else None
            if found and found.get("version"):
                versions[found["version"]].append(host["ip"])
        if len(versions) > 1:
            detail = "; ".join(f"{v} on {', '.join(ips)}" for v, ips in sorted(versions.items()))
            out.append(_problem("version_mismatch", f"TPU hosts run different {name} versions: {detail}"))
    return out
