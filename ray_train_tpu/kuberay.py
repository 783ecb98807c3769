"""``python -m ray_train_tpu kuberay``: a KubeRay manifest for TPU slices on GKE.

`build_manifest` turns a `Topology` into a ``RayCluster`` (or a ``RayJob`` that
wraps one) for the KubeRay operator, field names as in KubeRay's CRDs
(``ray-operator/config/crd/bases/ray.io_rayclusters.yaml``; a copy is in
``tests/data/kuberay/``). What it sets, per slice, in one worker group:

- ``numOfHosts`` = hosts per slice, ``replicas`` = ``minReplicas`` =
  ``maxReplicas`` = 1: a slice is created whole or not at all;
- node selectors ``cloud.google.com/gke-tpu-accelerator`` and
  ``cloud.google.com/gke-tpu-topology`` (GKE picks the TPU node pool by them);
- ``google.com/tpu`` = chips per host in container requests and limits;
- rayStartParams ``resources`` ``{"TPU": devices per host}``: on v7x that is two
  per chip (one per TensorCore), and ``RAY_TPU_RESOURCE_PER_CHIP=2`` goes on
  every pod, the head included, so that Ray counts the same way.

What GKE provides and this manifest leaves alone: the KubeRay TPU webhook
(GoogleCloudPlatform/ai-on-gke ``ray-on-gke/tpu/kuberay-tpu-webhook``, built into
GKE's Ray add-on) injects ``TPU_WORKER_ID``, ``TPU_NAME`` (``<group>-<replica>``)
and, on multi-host slices, ``TPU_WORKER_HOSTNAMES``; GKE TPU nodes carry
``TPU_ACCELERATOR_TYPE`` and ``TPU_TOPOLOGY``. From these Ray derives the node
labels its TPU scheduling uses (``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``,
``ray.io/tpu-pod-type``, ``ray.io/tpu-topology``, ``ray.io/accelerator-type``) and
the ``TPU-<pod type>-head`` resource. The manifest sets no ``ray.io/`` labels:
worker id and slice name differ per pod, while a group's ``labels`` are the same
for all of its pods, and Ray reserves the prefix for the labels it derives.
``TPU_SKIP_MDS_QUERY`` is not set either: on GKE the metadata server is there.

The default image, ``rayproject/ray:2.60.0-py311``, is a placeholder: pass
``--image`` with one that has torch, torch-tpu and ray_train_tpu installed.

Example:
    >>> from ray_train_tpu.topology import Topology
    >>> m = build_manifest(Topology.parse("4x4", "TPU-V6E"), num_slices=2)
    >>> [(g["groupName"], g["numOfHosts"]) for g in m["spec"]["workerGroupSpecs"]]
    [('tpu-slice-0', 4), ('tpu-slice-1', 4)]
"""

from __future__ import annotations

import json
import re
from typing import Optional

from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.topology import Topology

DEFAULT_RAY_VERSION = C.RAY_VERSION
DEFAULT_IMAGE = C.RAY_IMAGE  # placeholder: no torch, torch-tpu, ray_train_tpu
KINDS = ("RayCluster", "RayJob")
FORMATS = ("yaml", "json")

# GKE and KubeRay names, as KubeRay's TPU samples spell them
# (ray-operator/config/samples/ray-cluster.tpu-v6e-16-multihost.yaml).
GKE_TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
GKE_TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_CONTAINER_RESOURCE = "google.com/tpu"

# KubeRay's limits (ray-operator/controllers/ray/utils/constant.go): names it
# can extend into pod and service names without truncating them.
_MAX_NAME_LENGTH = {"RayCluster": 53, "RayJob": 47}
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")

_HEAD_RESOURCES = {"cpu": "4", "memory": "16Gi"}
_HEAD_PORTS = (("gcs", C.DEFAULT_RAY_GCS_PORT), ("dashboard", C.DEFAULT_RAY_DASHBOARD_PORT),
               ("client", C.DEFAULT_RAY_CLIENT_PORT))


def build_manifest(
    topology: Topology,
    *,
    num_slices: int = 1,
    kind: str = "RayCluster",
    image: str = DEFAULT_IMAGE,
    name: Optional[str] = None,
    entrypoint: Optional[str] = None,
    ray_version: str = DEFAULT_RAY_VERSION,
) -> dict:
    """A KubeRay ``RayCluster`` or ``RayJob`` for `num_slices` slices of `topology`.

    Args:
        topology: the slice, e.g. ``Topology.parse("4x4", "TPU-V6E")``.
        num_slices: slices in the job; each becomes one worker group.
        kind: ``"RayCluster"`` or ``"RayJob"``.
        image: container image for every pod; it needs torch, torch-tpu and
            ray_train_tpu (the default has none of them).
        name: ``metadata.name``; default ``ray-train-<pod type>``.
        entrypoint: the command a ``RayJob`` runs; required for, and only for, RayJob.
        ray_version: ``spec.rayVersion``; match the image.

    Raises:
        ValueError: naming the field, the value, the rule and the fix.
    """
    _check_inputs(topology, num_slices, kind, image, entrypoint)
    name = f"ray-train-{topology.pod_type}" if name is None else name
    _check_name(name, kind)
    cluster_spec = {
        "rayVersion": ray_version,
        "headGroupSpec": _head_group(topology, image),
        "workerGroupSpecs": [_worker_group(topology, image, i) for i in range(num_slices)],
    }
    if kind == "RayCluster":
        spec = cluster_spec
    else:
        # A TPU slice is expensive: give it back when the job ends.
        spec = {"entrypoint": entrypoint, "shutdownAfterJobFinishes": True, "rayClusterSpec": cluster_spec}
    return {"apiVersion": "ray.io/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}


def _check_inputs(topology, num_slices, kind, image, entrypoint) -> None:
    if not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be a Topology, got {type(topology).__name__} {topology!r}; "
            f"use Topology.parse('4x4', 'TPU-V6E')"
        )
    V.check_num_slices("", num_slices, fix=f"{V.MAX_NUM_SLICES_WHY}; pass --num-slices 1 or more")
    V.check_job_size(topology, num_slices)
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not a KubeRay kind this command writes; valid: {', '.join(KINDS)}")
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise ValueError(f"image {image!r} must be a container image reference without spaces, e.g. {DEFAULT_IMAGE}")
    if kind == "RayJob" and not (isinstance(entrypoint, str) and entrypoint.strip()):
        raise ValueError(f"entrypoint {entrypoint!r} is required for kind RayJob; pass e.g. --entrypoint 'python train.py'")
    if kind == "RayCluster" and entrypoint is not None:
        raise ValueError(
            f"entrypoint {entrypoint!r} is only used by kind RayJob; pass --kind RayJob or drop --entrypoint"
        )


def _check_name(name: object, kind: str) -> None:
    limit = _MAX_NAME_LENGTH[kind]
    if not isinstance(name, str) or not _DNS1035_LABEL.fullmatch(name) or len(name) > limit:
        raise ValueError(
            f"name {name!r} is not a valid {kind} name (KubeRay wants a DNS-1035 label of at most "
            f"{limit} characters: lower-case letters, digits and '-', starting with a letter); "
            f"pass e.g. --name ray-train-v6e-16"
        )


def _pod_env(topology: Topology) -> list[dict]:
    # v7x: Ray must count one TPU resource per TensorCore on every node and in
    # the driver, or {"TPU": 1} means a whole chip (two TorchTPU devices).
    if topology.devices_per_chip == 1:
        return []
    return [{"name": C.RAY_TPU_RESOURCE_PER_CHIP, "value": str(topology.devices_per_chip)}]


def _with_env(container: dict, env: list[dict]) -> dict:
    return {**container, "env": env} if env else container


def _head_group(topology: Topology, image: str) -> dict:
    container = {
        "name": "ray-head",
        "image": image,
        "resources": {"requests": dict(_HEAD_RESOURCES), "limits": dict(_HEAD_RESOURCES)},
        "ports": [{"containerPort": port, "name": name} for name, port in _HEAD_PORTS],
    }
    return {"rayStartParams": {}, "template": {"spec": {"containers": [_with_env(container, _pod_env(topology))]}}}


def _worker_group(topology: Topology, image: str, slice_id: int) -> dict:
    chips = str(topology.chips_per_host)
    container = {
        "name": "ray-worker",
        "image": image,
        "resources": {
            "requests": {TPU_CONTAINER_RESOURCE: chips},
            "limits": {TPU_CONTAINER_RESOURCE: chips},
        },
        # libtpu's multi-slice (DCN) traffic; MEGASCALE_PORT in the worker env.
        "ports": [{"containerPort": C.DEFAULT_MEGASCALE_PORT, "name": "mxla"}],
    }
    return {
        "groupName": f"tpu-slice-{slice_id}",
        "replicas": 1,
        "minReplicas": 1,
        "maxReplicas": 1,
        "numOfHosts": topology.num_hosts,
        "rayStartParams": {"resources": _ray_resources_param(topology)},
        "template": {
            "spec": {
                "containers": [_with_env(container, _pod_env(topology))],
                "nodeSelector": {
                    GKE_TPU_ACCELERATOR_LABEL: topology.generation.gke_accelerator,
                    GKE_TPU_TOPOLOGY_LABEL: topology.name,
                },
            }
        },
    }


def _ray_resources_param(topology: Topology) -> str:
    """rayStartParams ``resources`` for one host: ``'{"TPU":4}'``.

    Single-quoted JSON, as KubeRay itself writes it (``pod.go``
    ``updateRayStartParamsResources``); KubeRay strips the quotes to parse it.
    """
    return "'" + json.dumps({"TPU": topology.devices_per_host}, separators=(",", ":")) + "'"


def format_manifest(manifest: dict, fmt: str = "yaml") -> str:
    """The manifest as YAML (block style, field order kept) or indented JSON."""
    if fmt == "json":
        return json.dumps(manifest, indent=2) + "\n"
    if fmt == "yaml":
        import yaml  # PyYAML comes with ray; imported here so `plan` stays fast

        return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)
    raise ValueError(f"format {fmt!r} is not supported; valid: {', '.join(FORMATS)}")
