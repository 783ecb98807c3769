"""Where a TPU host sits, on GKE (variables) and on TPU VMs started with ``ray start``
(Ray's node labels, which Ray derives from the GCE metadata server), and which wins
where both are set (docs/environment.md). Ray 2.60's own TPUAcceleratorManager reads
the simulated TPU VM's metadata here, not a copy of its rules."""

import json
import logging
import types

import pytest
import ray

from ray_train_tpu import constants as C
from ray_train_tpu._compat import ray_tpu as compat_ray_tpu
from ray_train_tpu.discovery import host_identity
from ray_train_tpu.testing.simulated_cluster import _host_env, _tpu_vm_env, gce_metadata
from ray_train_tpu.testing.worker_env import in_scope
from ray_train_tpu.topology import Topology

LABELS = {C.LABEL_TPU_SLICE_NAME: "vm-a", C.LABEL_TPU_WORKER_ID: "1", C.LABEL_TPU_TOPOLOGY: "2x2x2",
          C.LABEL_TPU_POD_TYPE: "v4-16"}
GKE = {C.TPU_NAME: "gke-a", C.TPU_WORKER_ID: "0", C.TPU_TOPOLOGY: "2x2x2", C.TPU_ACCELERATOR_TYPE: "v4-16"}


def test_our_label_keys_are_rays():
    import ray._raylet as r

    assert (C.LABEL_TPU_SLICE_NAME, C.LABEL_TPU_WORKER_ID, C.LABEL_TPU_TOPOLOGY, C.LABEL_TPU_POD_TYPE,
            C.LABEL_ACCELERATOR_TYPE) == (r.RAY_NODE_TPU_SLICE_NAME_KEY, r.RAY_NODE_TPU_WORKER_ID_KEY,
                                          r.RAY_NODE_TPU_TOPOLOGY_KEY, r.RAY_NODE_TPU_POD_TYPE_KEY,
                                          r.RAY_NODE_ACCELERATOR_TYPE_KEY)


@pytest.mark.parametrize("env, labels, want, sources, conflicts", [
    # a TPU VM: labels only
    ({}, LABELS, ("vm-a", "1", "2x2x2", "v4-16"), {"slice_name": C.LABEL_TPU_SLICE_NAME}, 0),
    # GKE: variables only, or both agreeing (Ray derived the labels from them; spelling aside)
    (GKE, {}, ("gke-a", "0", "2x2x2", "v4-16"), {"slice_name": C.TPU_NAME}, 0),
    ({**GKE, C.TPU_TOPOLOGY: "2X2X2 ", C.TPU_ACCELERATOR_TYPE: "TPU-v4-16"},
     {**LABELS, C.LABEL_TPU_SLICE_NAME: "gke-a", C.LABEL_TPU_WORKER_ID: "0"},
     ("gke-a", "0", "2X2X2 ", "TPU-v4-16"), {"pod_type": C.TPU_ACCELERATOR_TYPE}, 0),
    # both, disagreeing: each variable wins and each disagreement is said
    (GKE, LABELS, ("gke-a", "0", "2x2x2", "v4-16"), {"worker_id": C.TPU_WORKER_ID}, 2),
    # per fact: a variable where set, the label for the rest (as Ray resolves each fact)
    ({C.TPU_NAME: "gke-a"}, LABELS, ("gke-a", "1", "2x2x2", "v4-16"),
     {"slice_name": C.TPU_NAME, "worker_id": C.LABEL_TPU_WORKER_ID}, 1),
    # an empty variable is unset (Ray's getters treat it so)
    ({C.TPU_NAME: ""}, LABELS, ("vm-a", "1", "2x2x2", "v4-16"), {"slice_name": C.LABEL_TPU_SLICE_NAME}, 0),
    ({}, {}, (None, None, None, None), {}, 0),
])
def test_the_variable_wins_per_fact_and_the_label_fills_in(env, labels, want, sources, conflicts):
    got = host_identity(env, labels)
    assert (got.slice_name, got.worker_id, got.topology, got.pod_type) == want
    assert sources.items() <= got.sources.items()
    assert len(got.conflicts) == conflicts
    for text in got.conflicts:
        assert "wins" in text and "but node label ray.io/tpu-" in text


@pytest.mark.parametrize("name, accel", [("2x2x2", "TPU-V4"), ("4x4", "TPU-V6E"), ("2x2x1", "TPU-V7X"),
                                         ("4x4x4", "TPU-V5P")])
def test_ray_names_a_simulated_tpu_vm_from_its_metadata(monkeypatch, name, accel):
    """Ray 2.60's own TPUAcceleratorManager, with no GKE variable and the simulated
    metadata server, derives the labels and resources a real TPU VM gets, and our
    identity from those labels is the host's place."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager as M

    t = Topology.parse(name, accel)
    for key in [k for k in _host_env(t, 0, 0) if in_scope(k)]:
        monkeypatch.delenv(key, raising=False)
    for worker_id in range(t.num_hosts):
        env = _tpu_vm_env(t, 3, worker_id)
        assert not {C.TPU_NAME, C.TPU_WORKER_ID, C.TPU_TOPOLOGY, C.TPU_ACCELERATOR_TYPE} & set(env)
        undo = compat_ray_tpu.answer_metadata_server(json.loads(env[C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA]))
        try:
            labels = M.get_current_node_accelerator_labels()
            resources = M.get_current_node_additional_resources()
            accelerator_type = M.get_current_node_accelerator_type()
        finally:
            undo()
        assert accelerator_type == t.accelerator_type
        assert (f"TPU-{t.pod_type}-head" in resources) == (worker_id == 0) and "sim-slice-3" in resources
        got = host_identity({k: v for k, v in env.items() if k != C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA}, labels)
        assert (got.slice_name, got.worker_id, got.topology, got.pod_type) == (
            "sim-slice-3", str(worker_id), t.name, t.pod_type)
        assert Topology.parse(got.topology, accel) == t


def test_the_metadata_guard_refuses_or_answers_and_undoes():
    from ray._private.accelerators import tpu as ray_tpu

    original = ray_tpu._get_tpu_metadata
    undo = compat_ray_tpu.answer_metadata_server(None)
    with pytest.raises(RuntimeError, match="GCE metadata server for 'instance-id'.*tpu_vm=True"):
        ray_tpu._get_tpu_metadata("instance-id")
    undo()
    undo = compat_ray_tpu.answer_metadata_server(gce_metadata(Topology.parse("2x2x2", "TPU-V4"), 0, 1))
    assert ray_tpu._get_tpu_metadata("agent-worker-number") == "1" and ray_tpu._get_tpu_metadata("nope") is None
    undo()
    assert ray_tpu._get_tpu_metadata is original


def test_the_worker_setup_hook_answers_for_its_own_host_only(monkeypatch):
    from ray._private.accelerators import tpu as ray_tpu

    monkeypatch.setattr(ray_tpu, "_get_tpu_metadata", ray_tpu._get_tpu_metadata)  # undone after the test
    monkeypatch.setenv(C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA, json.dumps({"instance-id": "vm-9"}))
    compat_ray_tpu.install_simulated_metadata()
    assert ray_tpu.TPUAcceleratorManager.get_current_node_tpu_name() == "vm-9"
    monkeypatch.delenv(C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA)
    compat_ray_tpu.install_simulated_metadata()  # a GKE host of the same cluster
    with pytest.raises(RuntimeError, match="GCE metadata server"):
        ray_tpu._get_tpu_metadata("instance-id")


class _Context:
    """What a Ray worker's runtime context answers, including what Ray's log filter
    (``ray._common.filters``) asks of a connected process when a warning is logged."""

    worker = types.SimpleNamespace(mode=None)  # not ray.WORKER_MODE: no task fields asked

    def __init__(self, labels, tpu_ids=("1",)):
        self.labels, self.tpu_ids = labels, list(tpu_ids)

    def get_job_id(self):
        return "01000000"

    def get_worker_id(self):
        return "w1"

    def get_accelerator_ids(self):
        return {"TPU": self.tpu_ids}

    def get_node_id(self):
        return "n1"

    def get_node_labels(self):
        return dict(self.labels)


@pytest.fixture
def worker(monkeypatch):
    """A Ray worker whose host carries `labels` and only the variables set on it."""
    from ray_train_tpu import _worker_fns

    for key in (C.TPU_NAME, C.TPU_WORKER_ID, C.TPU_TOPOLOGY, C.TPU_ACCELERATOR_TYPE):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.2")
    monkeypatch.setattr(_worker_fns, "_WARNED", set())

    def run(labels, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(ray, "get_runtime_context", lambda: _Context(labels))
        monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a Ray worker is connected
        return _worker_fns.report()

    return run


def test_a_tpu_vm_worker_reports_its_place_from_rays_labels(worker):
    r = worker(LABELS)
    assert (r.slice_name, r.tpu_worker_id, r.topology, r.accelerator_type) == ("vm-a", 1, "2x2x2", "v4-16")
    from ray_train_tpu import TPUTorchConfig
    from ray_train_tpu._backend import _resolve_topology

    assert _resolve_topology([r], TPUTorchConfig()) == Topology.parse("2x2x2", "TPU-V4")


def test_a_disagreement_is_warned_once_and_the_variable_wins(worker, caplog):
    with caplog.at_level(logging.WARNING, logger="ray_train_tpu._worker_fns"):
        r = worker(LABELS, TPU_WORKER_ID="0")
        worker(LABELS, TPU_WORKER_ID="0")
    assert r.tpu_worker_id == 0
    said = [m for m in caplog.messages if "TPU_WORKER_ID='0' but node label ray.io/tpu-worker-id='1'" in m]
    assert len(said) == 1 and "host 10.0.0.2" in said[0] and "TPU_WORKER_ID wins" in said[0]


def test_a_worker_id_label_that_is_no_integer_is_named(worker):
    with pytest.raises(ValueError, match=r"ray.io/tpu-worker-id='one' on host 10.0.0.2 is not an integer"):
        worker({**LABELS, C.LABEL_TPU_WORKER_ID: "one"})


def test_a_tpu_vm_without_a_name_still_fails_naming_what_is_missing(worker):
    from ray_train_tpu.discovery import LayoutError, layout

    import dataclasses

    r = worker({C.LABEL_TPU_TOPOLOGY: "2x2x2", C.LABEL_TPU_POD_TYPE: "v4-16"})
    assert r.slice_name is None
    infos = [dataclasses.replace(r, node_ip=f"10.0.0.{1 + i // 4}", tpu_ids=(i % 4,)).info(index=i, node_tpus=4)
             for i in range(8)]
    with pytest.raises(LayoutError, match="needs TPU_NAME .* or Ray's ray.io/tpu-slice-name node label"):
        layout(infos, Topology.parse("2x2x2", "TPU-V4"), 1)


def test_doctor_is_healthy_on_tpu_vms_that_carry_no_gke_variable():
    """doctor reads Ray's labels; a TPU VM's probe finds no TPU_* variable."""
    from ray_train_tpu.doctor import diagnose

    t = Topology.parse("2x2x2", "TPU-V4")
    nodes, probes = [], {}
    for w in range(2):
        labels = {C.LABEL_TPU_SLICE_NAME: "vm-a", C.LABEL_TPU_WORKER_ID: str(w), C.LABEL_TPU_POD_TYPE: t.pod_type,
                  C.LABEL_TPU_TOPOLOGY: t.name, C.LABEL_ACCELERATOR_TYPE: t.accelerator_type}
        resources = {"CPU": 5.0, "TPU": 4.0, "accelerator_type:TPU-V4": 1.0, "vm-a": 1.0}
        if w == 0:
            resources["TPU-v4-16-head"] = 1.0
        nodes.append({"NodeID": f"n{w}", "Alive": True, "NodeManagerAddress": f"10.0.0.{w + 1}",
                      "Resources": resources, "Labels": labels})
        probes[f"n{w}"] = {"packages": {"torch_tpu": {"found": True, "version": "0.2.0"},
                                        "libtpu": {"found": True, "version": "0.0.52"}},
                           "lockfile": "/tmp/libtpu_lockfile", "lockfile_holder": None, "env": {}}
    report = diagnose(nodes, probes)
    assert report["healthy"], report["problems"]
    assert report["slices"][0]["name"] == "vm-a" and report["slices"][0]["worker_ids"] == [0, 1]


def test_a_one_chip_engine_on_a_tpu_vm_finds_its_slice_from_rays_labels(worker, monkeypatch):
    """The serve/RL engine check reads the host's place the same way (before: TPU_NAME only)."""
    from ray_train_tpu.serve.worker_check import check_chip_engine

    worker(LABELS)  # no GKE variable; Ray's labels and one chip (TPU id 1) for this actor
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # inside a Ray worker
    assert check_chip_engine(slice_name="vm-a") == 1
    with pytest.raises(RuntimeError, match="meant for slice 'other' runs on slice 'vm-a' \\(TPU worker 1\\)"):
        check_chip_engine(slice_name="other")


def test_a_new_slice_of_another_shape_gets_the_next_id_and_its_own_hosts_env(monkeypatch):
    """SimulatedTPUCluster.add_slice(topology=...): a two-host v4 slice beside one-host
    ones, numbered after every slice the cluster has, each host with its own slice's
    variables; a call that names neither a slice nor a shape is refused."""
    from ray_train_tpu.testing.simulated_cluster import SimulatedTPUCluster

    class _Cluster:
        def wait_for_nodes(self):
            pass

    sim = SimulatedTPUCluster(topology=Topology.parse("2x2x1", "TPU-V4"), num_slices=2, address="", hosts={},
                              cluster=_Cluster())
    started = []
    monkeypatch.setattr(SimulatedTPUCluster, "add_host",
                        lambda self, s, w, topology=None: started.append((s, w, topology.name)) or
                        self._nodes.__setitem__((s, w), None))
    for s in range(2):
        sim._nodes[(s, 0)] = None
    assert sim.add_slice(topology="2x2x2") == 2 and started == [(2, 0, "2x2x2"), (2, 1, "2x2x2")]
    assert sim.host_env((2, 1))[C.TPU_WORKER_HOSTNAMES] == "127.0.3.1,127.0.3.2"
    assert sim.host_env((2, 1))[C.TPU_TOPOLOGY] == "2x2x2" and sim.host_env((0, 0))[C.TPU_TOPOLOGY] == "2x2x1"
    with pytest.raises(ValueError, match=r"add_slice\(slice_id=None, topology=None\).*topology='2x2x2'"):
        sim.add_slice()
