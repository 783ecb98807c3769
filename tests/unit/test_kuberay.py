"""python -m ray_train_tpu kuberay: manifests KubeRay accepts, one worker group per whole slice.

Every manifest is validated against the openAPIV3Schema of KubeRay's own CRDs
(tests/data/kuberay/, see its README), made strict so that a misspelt field fails.
"""

import io
import json
import pathlib
import subprocess
import sys

import jsonschema
import pytest
import yaml

from ray_train_tpu.cli import main
from ray_train_tpu.kuberay import build_manifest
from ray_train_tpu.topology import Topology

CRD_DIR = pathlib.Path(__file__).resolve().parents[1] / "data" / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}

# Each generation: a single-host slice and a multi-host one (v6e 2x4 is 8 chips on one host).
SLICES = [
    ("TPU-V4", "2x2x1"), ("TPU-V4", "2x2x2"),
    ("TPU-V5P", "2x2x1"), ("TPU-V5P", "2x2x4"),
    ("TPU-V5LITEPOD", "1x1"), ("TPU-V5LITEPOD", "4x4"),
    ("TPU-V6E", "2x4"), ("TPU-V6E", "4x4"), ("TPU-V6E", "16x16"),
    ("TPU-V7X", "2x2x1"), ("TPU-V7X", "4x4x4"),
]
CASES = [
    pytest.param(acc, topo, kind, n, id=f"{acc}-{topo}-{kind}-x{n}")
    for acc, topo in SLICES for kind in ("RayCluster", "RayJob") for n in (1, 3)
]


def _strict(node):
    """A k8s structural schema as plain JSON Schema, with unknown fields rejected.

    The API server prunes unknown fields silently; here they fail, so that a
    misspelt field name is caught. `x-kubernetes-int-or-string` without `anyOf`
    becomes integer-or-string, `nullable` adds null. CEL rules
    (`x-kubernetes-validations`) are not evaluated: they guard managedBy,
    gcsFaultToleranceOptions and deletionStrategy, none of which we set.
    """
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: _strict(v) for k, v in node.items()
        if k != "properties" and k != "nullable" and not k.startswith("x-kubernetes-")
    }
    if "properties" in node:  # a map of field names, not a schema
        out["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


@pytest.fixture(scope="module")
def validators():
    out = {}
    for kind, filename in CRD_FILES.items():
        crd = yaml.load((CRD_DIR / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        assert crd["spec"]["names"]["kind"] == kind and version["served"]
        out[kind] = jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))
    return out


def _manifest(acc, topo, kind="RayCluster", num_slices=1, **kw):
    if kind == "RayJob":
        kw.setdefault("entrypoint", "python train.py")
    return build_manifest(Topology.parse(topo, acc), num_slices=num_slices, kind=kind, **kw)


def _cluster_spec(m):
    return m["spec"]["rayClusterSpec"] if m["kind"] == "RayJob" else m["spec"]


def _pods(m):
    spec = _cluster_spec(m)
    return [spec["headGroupSpec"]] + spec["workerGroupSpecs"]


def _env(group):
    (container,) = group["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _kuberay_resources(param):
    # KubeRay's getResourcesMap (ray-operator/controllers/ray/common/pod.go).
    return json.loads(param.strip("'\"` "))


@pytest.mark.parametrize("acc, topo, kind, num_slices", CASES)
def test_manifest_matches_kuberay_crd(validators, acc, topo, kind, num_slices):
    m = _manifest(acc, topo, kind, num_slices)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[kind].iter_errors(m)]
    assert errors == []
    assert (m["apiVersion"], m["kind"]) == ("ray.io/v1", kind)


@pytest.mark.parametrize("acc, topo, kind, num_slices", CASES)
def test_one_worker_group_per_slice_of_whole_hosts(acc, topo, kind, num_slices):
    t = Topology.parse(topo, acc)
    groups = _cluster_spec(_manifest(acc, topo, kind, num_slices))["workerGroupSpecs"]
    assert len(groups) == num_slices and len({g["groupName"] for g in groups}) == num_slices
    for g in groups:
        (c,) = g["template"]["spec"]["containers"]
        tpu = c["resources"]["limits"]["google.com/tpu"]
        assert c["resources"]["requests"]["google.com/tpu"] == tpu
        assert g["numOfHosts"] * int(tpu) == t.num_chips
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 1)
        assert g["template"]["spec"]["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": t.generation.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": topo,
        }
        resources = _kuberay_resources(g["rayStartParams"]["resources"])
        assert resources == {"TPU": int(tpu) * t.devices_per_chip}


@pytest.mark.parametrize("acc, topo, kind, num_slices", CASES)
def test_rules_kuberay_and_the_gke_tpu_webhook_check(acc, topo, kind, num_slices):
    m = _manifest(acc, topo, kind, num_slices)
    # ray-operator/controllers/ray/utils/validation.go: names, labels, resources.
    assert len(m["metadata"]["name"]) <= {"RayCluster": 53, "RayJob": 47}[kind]
    for group in _pods(m):
        assert "labels" not in group["rayStartParams"]
        assert not ("resources" in group and "resources" in group["rayStartParams"])
        assert not any(k.startswith("ray.io/") for k in group.get("labels", {}))
    # kuberay-tpu-webhook checkWorkersMatchTopology: hosts = max(chips in the
    # topology label / google.com/tpu per pod, 1), else the RayCluster is refused.
    for g in _cluster_spec(m)["workerGroupSpecs"]:
        chips = 1
        for d in g["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"].split("x"):
            chips *= int(d)
        tpu = int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"])
        assert g["numOfHosts"] == max(chips // tpu, 1)
    head = _cluster_spec(m)["headGroupSpec"]
    assert "google.com/tpu" not in json.dumps(head) and "TPU" not in head["rayStartParams"]


@pytest.mark.parametrize("acc, topo", SLICES)
def test_v7x_counts_tensorcores_on_every_pod_and_the_head(acc, topo):
    m = _manifest(acc, topo, num_slices=2)
    per_chip = Topology.parse(topo, acc).devices_per_chip
    for group in _pods(m):
        env = _env(group)
        assert env.get("RAY_TPU_RESOURCE_PER_CHIP") == (str(per_chip) if per_chip > 1 else None)
        assert "TPU_SKIP_MDS_QUERY" not in env  # GKE has a metadata server


def test_rayjob_wraps_the_raycluster_spec():
    cluster = _manifest("TPU-V6E", "4x4", num_slices=2, name="train")
    job = _manifest("TPU-V6E", "4x4", "RayJob", num_slices=2, name="train", entrypoint="python train.py --steps 10")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert job["spec"]["entrypoint"] == "python train.py --steps 10"
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert job["metadata"] == cluster["metadata"] == {"name": "train"}


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("extra", [(), ("--kind", "RayJob", "--entrypoint", "python -m my.train --lr 0.1")])
def test_yaml_output_parses_and_equals_json(extra):
    argv = ("kuberay", "--topology", "2x2x2", "--accelerator-type", "TPU-V7X", "--num-slices", "2",
            "--image", "us-docker.pkg.dev/p/r/train:1") + extra
    code, out_yaml, err = _run(*argv)
    assert code == 0 and err == ""
    code, out_json, _ = _run(*argv, "--format", "json")
    assert code == 0
    assert yaml.safe_load(out_yaml) == json.loads(out_json)
    m = json.loads(out_json)
    assert _cluster_spec(m)["headGroupSpec"]["template"]["spec"]["containers"][0]["image"].endswith("train:1")


def test_cli_defaults_to_a_yaml_raycluster():
    code, out, _ = _run("kuberay", "--topology", "4x4", "--accelerator-type", "v6e")
    m = yaml.safe_load(out)
    assert code == 0 and m["kind"] == "RayCluster" and m["metadata"]["name"] == "ray-train-v6e-16"
    assert m == build_manifest(Topology.parse("4x4", "TPU-V6E"))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--topology", "4x5", "--accelerator-type", "TPU-V6E"], "valid: 1x1, 2x2, 2x4, 4x4"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--num-slices", "0"], "num_slices must be an integer in 1..256, got 0"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--kind", "RayService"], "invalid choice"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--kind", "RayJob"], "required for kind RayJob"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--entrypoint", "x"], "only used by kind RayJob"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--name", "My_Cluster"], "DNS-1035"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--name", "a" * 54], "at most 53"),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--format", "toml"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, match):
    code, out, err = _run("kuberay", *argv)
    assert code == 2 and out == ""
    assert err.startswith("ray_train_tpu: error: ") and err.count("\n") == 1
    assert match in err


def test_build_manifest_rejects_what_the_cli_cannot_send():
    t = Topology.parse("4x4", "TPU-V6E")
    with pytest.raises(TypeError, match="Topology.parse"):
        build_manifest("4x4")
    with pytest.raises(ValueError, match="valid: RayCluster, RayJob"):
        build_manifest(t, kind="RayService")
    with pytest.raises(ValueError, match="num_slices must be an integer in 1..256, got True"):
        build_manifest(t, num_slices=True)
    with pytest.raises(ValueError, match="at most 47"):
        build_manifest(t, kind="RayJob", entrypoint="python x.py", name="a" * 48)


def test_kuberay_command_does_not_import_ray_or_torch():
    code = ("import sys; from ray_train_tpu.cli import main; main(['kuberay','--topology','4x4',"
            "'--accelerator-type','TPU-V6E']); "
            "assert 'ray' not in sys.modules and 'torch' not in sys.modules, 'heavy import'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_strict_schema_rejects_a_misspelt_field(validators):
    m = _manifest("TPU-V6E", "4x4")
    m["spec"]["workerGroupSpecs"][0]["numOfHost"] = 4
    m["spec"]["workerGroupSpecs"][0]["replicas"] = "1"
    messages = sorted(e.message for e in validators["RayCluster"].iter_errors(m))
    assert messages == ["'1' is not of type 'integer'", "Additional properties are not allowed ('numOfHost' was unexpected)"]
