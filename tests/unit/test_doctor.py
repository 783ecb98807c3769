"""doctor: every check on `ray.nodes()`-shaped dicts and probe answers, without Ray."""

import io
import json
import re
import subprocess
import sys

import pytest

from ray_train_tpu import doctor
from ray_train_tpu.cli import main
from ray_train_tpu.doctor import (
    ACCELERATOR_LABEL,
    POD_TYPE_LABEL,
    SLICE_LABEL,
    TOPOLOGY_LABEL,
    WORKER_ID_LABEL,
    diagnose,
    format_report_table,
    lockfile_holder,
)


def node(ip, slice_name="s0", worker=0, *, tpu=4, accel="TPU-V4", topology="2x2x2", pod="v4-16", head=None,
         labels=None, alive=True):
    """A TPU host as `ray.nodes()` shows it (Ray 2.60)."""
    resources = {"CPU": 5.0, "TPU": float(tpu), f"accelerator_type:{accel}": 1.0, slice_name: 1.0,
                 f"node:{ip}": 1.0}
    if head if head is not None else worker == 0:
        resources[f"TPU-{pod}-head"] = 1.0
    lab = {SLICE_LABEL: slice_name, WORKER_ID_LABEL: str(worker), POD_TYPE_LABEL: pod,
           TOPOLOGY_LABEL: topology, ACCELERATOR_LABEL: accel, "ray.io/node-id": f"id-{ip}"}
    lab.update(labels or {})
    return {"NodeID": f"id-{ip}", "Alive": alive, "NodeManagerAddress": ip,
            "Resources": resources, "Labels": {k: v for k, v in lab.items() if v is not None}}


HEAD_NODE = {"NodeID": "id-head", "Alive": True, "NodeManagerAddress": "10.0.0.1",
             "Resources": {"CPU": 1.0, "node:__internal_head__": 1.0}, "Labels": {"ray.io/node-id": "id-head"}}


def probe(*, torch_tpu=True, libtpu=True, holder=None, env=None, versions=("0.2.0", "0.0.52")):
    return {"packages": {"torch_tpu": {"found": torch_tpu, "version": versions[0] if torch_tpu else None},
                         "libtpu": {"found": libtpu, "version": versions[1] if libtpu else None}},
            "lockfile": "/tmp/libtpu_lockfile", "lockfile_holder": holder, "env": dict(env or {})}


def v4_slice(name="s0", slice_index=0):
    """A healthy v4 2x2x2 slice: 2 hosts x 4 chips."""
    return [node(f"10.0.{slice_index}.{w + 1}", name, w) for w in range(2)]


def probes_for(nodes, **overrides):
    """A healthy probe answer for every node; `overrides` by IP."""
    return {n["NodeID"]: overrides.get(n["NodeManagerAddress"], probe()) for n in nodes}


def checks(report, check=None):
    found = [p for p in report["problems"] if check is None or p["check"] == check]
    return found if check else sorted({p["check"] for p in found})


# --- Healthy clusters --------------------------------------------------------------------------------


def test_healthy_multi_host_slice_reports_slices_and_hosts():
    nodes = [HEAD_NODE] + v4_slice()
    report = diagnose(nodes, probes_for(nodes))
    assert report["healthy"] and report["problems"] == [] and report["num_nodes"] == 3
    assert report["slices"] == [{"name": "s0", "accelerator_type": "TPU-V4", "topology": "2x2x2",
                                 "pod_type": "v4-16", "num_hosts": 2, "num_hosts_expected": 2,
                                 "worker_ids": [0, 1], "hosts": ["10.0.0.1", "10.0.0.2"]}]
    h0, h1 = report["hosts"]
    assert (h0["ip"], h0["worker_id"], h0["chips"], h0["head_resources"]) == ("10.0.0.1", 0, 4, ["TPU-v4-16-head"])
    assert (h1["worker_id"], h1["head_resources"]) == (1, [])
    assert h0["labels"][TOPOLOGY_LABEL] == "2x2x2" and "ray.io/node-id" not in h0["labels"]
    assert h0["probe"]["packages"]["torch_tpu"]["found"]
    json.dumps(report)  # --format json


def test_v7x_counts_two_tpu_resources_per_chip():
    nodes = [node("10.0.0.1", "v7", 0, tpu=8, accel="TPU-V7X", topology="2x2x1", pod="v7x-8")]
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.1": probe(env={"RAY_TPU_RESOURCE_PER_CHIP": "2"})}))
    assert report["healthy"], report["problems"]
    assert report["hosts"][0]["chips"] == 4 and report["hosts"][0]["tpu_resources"] == 8


def test_without_probe_answers_only_node_checks_run():
    report = diagnose(v4_slice())
    assert report["healthy"] and all(h["probe"] is None for h in report["hosts"])


def test_dead_nodes_and_cpu_nodes_are_not_tpu_hosts():
    nodes = [HEAD_NODE, node("10.0.9.9", "old", 0, alive=False)] + v4_slice()
    report = diagnose(nodes)
    assert report["healthy"] and [s["name"] for s in report["slices"]] == ["s0"]
    assert report["num_nodes"] == 3


def test_no_tpu_hosts():
    report = diagnose([HEAD_NODE])
    assert not report["healthy"] and checks(report) == ["no_tpu_hosts"]


# --- One fault each ------------------------------------------------------------------------------


def test_missing_host():
    report = diagnose(v4_slice()[:1])
    (p,) = checks(report, "missing_host")
    assert checks(report) == ["missing_host"]
    assert p["slice"] == "s0" and "TPU worker id(s) 1 are not in the cluster" in p["message"]
    assert report["slices"][0]["num_hosts"] == 1 and report["slices"][0]["num_hosts_expected"] == 2


def test_duplicate_worker_id():
    nodes = [node("10.0.0.1", "s0", 0), node("10.0.0.2", "s0", 0, head=False), node("10.0.0.3", "s0", 1)]
    report = diagnose(nodes)
    (p,) = checks(report, "duplicate_worker_id")
    assert checks(report) == ["duplicate_worker_id"]
    assert "2 hosts say they are TPU worker 0 (10.0.0.1, 10.0.0.2)" in p["message"]


def test_worker_id_outside_the_topology():
    nodes = v4_slice() + [node("10.0.0.3", "s0", 2)]
    report = diagnose(nodes)
    (p,) = checks(report, "unexpected_worker_id")
    assert checks(report) == ["unexpected_worker_id"] and p["ip"] == "10.0.0.3"
    assert "worker ids 0..1" in p["message"]


def test_worker_id_label_that_is_not_a_number():
    nodes = [v4_slice()[0], node("10.0.0.2", "s0", 1, labels={WORKER_ID_LABEL: "one"})]
    report = diagnose(nodes)
    assert checks(report) == ["bad_worker_id", "missing_host"]
    assert checks(report, "bad_worker_id")[0]["ip"] == "10.0.0.2"


def test_missing_labels():
    bare = node("10.0.0.5", labels={SLICE_LABEL: None, TOPOLOGY_LABEL: None})
    report = diagnose([bare])
    (p,) = checks(report, "missing_label")
    assert checks(report) == ["missing_label"] and report["slices"] == []
    assert "ray.io/tpu-slice-name, ray.io/tpu-topology" in p["message"]


def test_missing_head_resource_on_worker_0():
    nodes = [node("10.0.0.1", "s0", 0, head=False), node("10.0.0.2", "s0", 1)]
    report = diagnose(nodes)
    (p,) = checks(report, "missing_head_resource")
    assert checks(report) == ["missing_head_resource"] and p["slice"] == "s0"
    assert "worker 0 (10.0.0.1) has no TPU-v4-16-head resource" in p["message"]


def test_head_resource_named_after_another_pod_type_is_missing():
    nodes = [node("10.0.0.1", "s0", 0, topology="2x2x1", pod="v4-8", head=False)]
    nodes[0]["Resources"]["TPU-v4-16-head"] = 1.0
    report = diagnose(nodes)
    assert checks(report) == ["missing_head_resource"]
    assert "(has TPU-v4-16-head)" in checks(report, "missing_head_resource")[0]["message"]


def test_head_resource_on_another_worker():
    nodes = [node("10.0.0.1", "s0", 0), node("10.0.0.2", "s0", 1, head=True)]
    report = diagnose(nodes)
    assert checks(report) == ["misplaced_head_resource"]
    assert checks(report, "misplaced_head_resource")[0]["ip"] == "10.0.0.2"


def test_hosts_of_a_slice_with_different_chip_counts():
    nodes = [node("10.0.0.1", "s0", 0), node("10.0.0.2", "s0", 1, tpu=3)]
    report = diagnose(nodes)
    assert checks(report) == ["chip_count_mismatch", "topology_chips_mismatch"]
    assert "10.0.0.1: 4, 10.0.0.2: 3" in checks(report, "chip_count_mismatch")[0]["message"]
    (p,) = checks(report, "topology_chips_mismatch")
    assert p["ip"] == "10.0.0.2" and "2 host(s) x 4 chips" in p["message"]


def test_topology_label_that_does_not_match_the_chips():
    # One 8-chip v6e host that says it is a 4x4 slice: that is 4 hosts x 4 chips.
    nodes = [node("10.0.0.1", "v6", 0, tpu=8, accel="TPU-V6E", topology="4x4", pod="v6e-16")]
    report = diagnose(nodes)
    assert checks(report) == ["missing_host", "topology_chips_mismatch"]
    assert "4 host(s) x 4 chips, but host 10.0.0.1 (worker 0) has 8 chip(s)" in \
        checks(report, "topology_chips_mismatch")[0]["message"]


def test_pod_type_that_does_not_match_the_topology():
    # Ray names the head resource after the pod type it was given: TPU-v4-8-head.
    nodes = [node(f"10.0.0.{w + 1}", "s0", w, pod="v4-8") for w in range(2)]
    report = diagnose(nodes)
    (p,) = checks(report, "pod_type_mismatch")
    assert "ray.io/tpu-pod-type=v4-8, but TPU-V4 2x2x2 is v4-16" in p["message"]
    assert checks(report) == ["missing_head_resource", "pod_type_mismatch"]
    assert "no TPU-v4-16-head resource (has TPU-v4-8-head)" in checks(report, "missing_head_resource")[0]["message"]


def test_topology_label_that_is_not_a_slice():
    report = diagnose([node("10.0.0.1", "s0", 0, topology="3x3x3")])
    (p,) = checks(report, "bad_topology")
    assert checks(report) == ["bad_topology"] and "valid: 2x2x1, 2x2x2" in p["message"]


def test_hosts_of_a_slice_that_disagree_on_labels():
    nodes = [node("10.0.0.1", "s0", 0), node("10.0.0.2", "s0", 1, topology="2x2x4")]
    report = diagnose(nodes)
    assert checks(report) == ["inconsistent_labels"]
    assert "10.0.0.1: 2x2x2, 10.0.0.2: 2x2x4" in report["problems"][0]["message"]


def test_torch_tpu_or_libtpu_missing():
    nodes = v4_slice()
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.1": probe(torch_tpu=False),
                                                  "10.0.0.2": probe(libtpu=False)}))
    assert checks(report) == ["libtpu_missing", "torch_tpu_missing"]
    assert checks(report, "torch_tpu_missing")[0]["ip"] == "10.0.0.1"
    assert checks(report, "libtpu_missing")[0]["ip"] == "10.0.0.2"


def test_lockfile_held():
    nodes = v4_slice()
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.2": probe(holder={"pid": 4242, "name": "python"})}))
    (p,) = checks(report, "lockfile_held")
    assert checks(report) == ["lockfile_held"] and p["ip"] == "10.0.0.2"
    assert "/tmp/libtpu_lockfile is held by process 4242 (python)" in p["message"]


@pytest.mark.parametrize("accel, topology, pod, tpu, value, bad", [
    ("TPU-V7X", "2x2x1", "v7x-8", 4, None, True),
    ("TPU-V7X", "2x2x1", "v7x-8", 4, "1", True),
    ("TPU-V7X", "2x2x1", "v7x-8", 8, "2", False),
    ("TPU-V4", "2x2x1", "v4-8", 8, "2", True),
    ("TPU-V4", "2x2x1", "v4-8", 4, "1", False),
])
def test_resource_per_chip(accel, topology, pod, tpu, value, bad):
    nodes = [node("10.0.0.1", "s", 0, tpu=tpu, accel=accel, topology=topology, pod=pod)]
    env = {"RAY_TPU_RESOURCE_PER_CHIP": value} if value else {}
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.1": probe(env=env)}))
    assert checks(report) == (["resource_per_chip"] if bad else [])
    if bad and accel == "TPU-V7X":
        assert "start Ray with RAY_TPU_RESOURCE_PER_CHIP=2" in report["problems"][0]["message"]


def test_v7x_without_resource_per_chip_and_no_probe_answer_counts_chips_as_expected():
    nodes = [node("10.0.0.1", "v7", 0, tpu=4, accel="TPU-V7X", topology="2x2x1", pod="v7x-8")]
    report = diagnose(nodes)  # 4 TPU resources at 2 per chip: 2 chips, not 4
    assert checks(report) == ["topology_chips_mismatch"]


def test_env_that_disagrees_with_labels():
    nodes = v4_slice()
    env = {"TPU_NAME": "s0", "TPU_WORKER_ID": "1", "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2"}
    good = dict(env, TPU_WORKER_ID="1")
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.1": probe(env=env), "10.0.0.2": probe(env=good)}))
    (p,) = checks(report, "env_label_mismatch")
    assert checks(report) == ["env_label_mismatch"] and p["ip"] == "10.0.0.1"
    assert "TPU_WORKER_ID='1' but ray.io/tpu-worker-id='0'" in p["message"]


def test_different_versions_across_hosts():
    nodes = v4_slice()
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.2": probe(versions=("0.3.0", "0.0.52"))}))
    assert checks(report) == ["version_mismatch"]
    assert "torch_tpu versions: 0.2.0 on 10.0.0.1; 0.3.0 on 10.0.0.2" in report["problems"][0]["message"]


def test_host_that_does_not_answer_or_fails():
    nodes = v4_slice()
    report = diagnose(nodes, {"id-10.0.0.1": {"error": "did not answer within 5 s", "timed_out": True},
                              "id-10.0.0.2": {"error": "failed: ModuleNotFoundError", "timed_out": False}})
    assert checks(report) == ["host_check_failed", "host_check_timeout"]
    assert checks(report, "host_check_timeout")[0]["ip"] == "10.0.0.1"


def test_every_documented_check_is_tested_here():
    documented = set(re.findall(r"``([a-z_]+)``", doctor.__doc__.split("Checks")[1].split("Example")[0]))
    source = open(__file__).read()
    tested = set(re.findall(r'"([a-z_]+)"', source))
    assert documented - {"check", "2x2x2", "v4-16"} <= tested, documented - tested


# --- Reports for people --------------------------------------------------------------------------


def test_table_shows_hosts_and_problems():
    nodes = [HEAD_NODE] + v4_slice() + [node("10.0.1.1", "s1", 0)]
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.2": probe(torch_tpu=False, holder={"pid": 7, "name": None})}))
    text = format_report_table(dict(report, address="10.0.0.1:6379"))
    assert text.startswith("Ray cluster 10.0.0.1:6379: 4 node(s), 3 TPU host(s) in 2 slice(s)")
    assert re.search(r"s0\s+TPU-V4\s+2x2x2\s+v4-16\s+2/2\s+0,1", text)
    assert re.search(r"s1\s+TPU-V4\s+2x2x2\s+v4-16\s+1/2\s+0\n", text)
    assert re.search(r"10.0.0.2\s+s0\s+1\s+4\s+4\s+-\s+v4-16\s+2x2x2\s+MISSING\s+0.0.52\s+HELD by 7", text)
    assert "3 problem(s):\n  torch_tpu_missing: host 10.0.0.2 (worker 1)" in text
    assert "  missing_host: slice s1:" in text


def test_healthy_table_says_so():
    nodes = v4_slice()
    assert format_report_table(diagnose(nodes, probes_for(nodes))).endswith("healthy: no problems found\n")


# --- On the host ---------------------------------------------------------------------------------


def test_lockfile_holder_names_the_process_that_holds_it(tmp_path):
    path = tmp_path / "libtpu_lockfile"
    assert lockfile_holder(str(path)) is None  # absent
    path.write_text("")
    assert lockfile_holder(str(path)) is None  # free
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.lockf(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        found = lockfile_holder(str(path))
        assert found is not None and found["pid"] == holder.pid and found["name"].startswith("python")
    finally:
        holder.communicate("")
    assert lockfile_holder(str(path)) is None


def test_probe_finds_packages_without_importing_torch_or_ray():
    code = ("import json, sys; from ray_train_tpu.doctor import probe_host; r = probe_host(); "
            "print(json.dumps([r, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_tpu', "
            "'libtpu', 'ray'))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    report, imported = json.loads(out)
    assert imported == []
    assert report["packages"]["torch_tpu"] == {"found": True, "version": report["packages"]["torch_tpu"]["version"]}
    assert report["packages"]["libtpu"]["found"] and report["lockfile"] == "/tmp/libtpu_lockfile"


def test_testing_knobs_work_on_simulated_hosts_only(monkeypatch, tmp_path):
    monkeypatch.setenv(doctor.SIMULATE_MISSING_MODULES, "torch_tpu")
    monkeypatch.setenv(doctor.SIMULATE_LIBTPU_LOCKFILE, str(tmp_path / "lock"))
    monkeypatch.delenv("RAY_TRAIN_TPU_SIMULATE", raising=False)
    real = doctor.probe_host()
    assert real["packages"]["torch_tpu"]["found"] and real["lockfile"] == "/tmp/libtpu_lockfile"
    monkeypatch.setenv("RAY_TRAIN_TPU_SIMULATE", "1")
    simulated = doctor.probe_host()
    assert not simulated["packages"]["torch_tpu"]["found"] and simulated["packages"]["libtpu"]["found"]
    assert simulated["lockfile"] == str(tmp_path / "lock")


# --- CLI -----------------------------------------------------------------------------------------


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv, match", [
    (["doctor", "--address", "nonsense"], "--address 'nonsense' is not a Ray cluster address"),
    (["doctor", "--address", "127.0.0.201:70000"], "is not a Ray cluster address"),
    # Nothing listens there: refused at once, before Ray would retry for minutes.
    (["doctor", "--address", "127.0.0.201:9"], "cannot connect to Ray at 127.0.0.201:9: Connection refused"),
    (["doctor", "--timeout", "0", "--address", "127.0.0.201:9"], "timeout must be a finite number of seconds in (0, 604800], got 0.0"),
    (["doctor", "--format", "yaml"], "invalid choice: 'yaml'"),
])
def test_bad_input_or_no_cluster_is_one_line_and_status_2(argv, match):
    code, out, err = _run(*argv)
    assert code == 2 and out == ""
    assert err.startswith("ray_train_tpu: error: ") and err.count("\n") == 1
    assert match in err


def test_ray_address_from_the_environment_is_checked(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "not an address")
    code, _, err = _run("doctor")
    assert code == 2 and "$RAY_ADDRESS 'not an address'" in err


def test_doctor_is_a_command(capsys):
    code, _, _ = _run("doctor", "--help")
    assert code == 0 and "--address" in capsys.readouterr().out


def test_job_env_that_cannot_describe_the_slice_is_reported_per_host():
    nodes = v4_slice()  # 10.0.0.1, 10.0.0.2: a v4 2x2x2 slice, 8 devices
    webhook = {"TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc", "TORCH_TPU_TOPOLOGY": "2x2x2",
               "TORCH_TPU_SLICEBUILDER_ADDRESSES": ",".join(f"w-{h}.svc:{8471 + i}" for h in range(2) for i in range(4))}
    stale = {"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.9.9.1:8476,10.9.9.2:8476", "TORCH_TPU_TOPOLOGY": "4,4,1",
             "MEGASCALE_COORDINATOR_ADDRESS": "10.8.0.1:8081"}
    report = diagnose(nodes, probes_for(nodes, **{"10.0.0.1": probe(env=webhook), "10.0.0.2": probe(env=stale)}))
    (p,) = checks(report, "stale_job_env")
    assert checks(report) == ["stale_job_env"] and p["ip"] == "10.0.0.2"  # the webhook's values fit the slice
    for text in ("TORCH_TPU_SLICEBUILDER_ADDRESSES has 2 address(es), the slice has 8",
                 "TORCH_TPU_TOPOLOGY='4,4,1' is not a 8-chip slice",
                 "MEGASCALE_COORDINATOR_ADDRESS='10.8.0.1:8081' is on no node"):
        assert text in p["message"], p["message"]
    coordinator_here = probe(env={"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:8081"})
    assert diagnose(nodes, probes_for(nodes, **{"10.0.0.2": coordinator_here}))["healthy"]


def test_free_port_is_below_the_ephemeral_range_and_bindable(monkeypatch, tmp_path):
    """A rendezvous port the kernel will not hand to an outgoing connection meanwhile."""
    import socket

    from ray_train_tpu import _host

    low = _host._ephemeral_low()
    ports = {_host.free_port() for _ in range(5)}
    assert all(_host._LISTEN_PORTS_FLOOR <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # A kernel whose ephemeral range starts low leaves no such room: the kernel's choice.
    ranges = tmp_path / "range"
    ranges.write_text("1024\t60999\n")
    monkeypatch.setattr(_host, "_EPHEMERAL_RANGE_FILE", str(ranges))
    assert _host._ephemeral_low() == 1024 and _host.free_port() > 0
