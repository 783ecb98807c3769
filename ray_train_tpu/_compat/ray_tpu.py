"""Ray's TPU slice helpers (``ray.util.tpu``, ``ray._private.accelerators.tpu``),
pinned to `constants.RAY_VERSION`; tests/unit/test_compat.py checks each seam.

Node labels. Ray names a TPU host by node labels (``ray._raylet.RAY_NODE_TPU_*_KEY``:
``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``, ...) that it derives when the
node starts: from GKE's variables, else (a TPU VM started with ``ray start``) from
the GCE metadata server (``_get_tpu_metadata``). `constants.LABEL_*` spell the same
keys; test_compat checks them against Ray's.

The GCE metadata query. Simulation never lets it reach the network: it fails
loudly (`answer_metadata_server(None)`), or answers as the metadata server of a
simulated TPU VM would (`answer_metadata_server(answers)`; in the workers of such
a host, `install_simulated_metadata`, run as Ray's worker setup hook).

The slice reservation. Ray Train reserves a multi-host slice through
``SlicePlacementGroup``, which calls ``reserve_tpu_slice`` (bound in
``ray.util.tpu``) without a slice name: a placement group on any free head
resource of the right pod type, i.e. on any slice's worker 0 host, including a
slice that lost another host (its docstring warns of it). The gang then cannot
schedule and the attempt waits out Ray Train's worker-group start timeout.
`install_slice_reservation` replaces that name with `reserve_intact_slice`,
which excludes every slice with a host missing from the cluster's live nodes
(a ``!in(...)`` label selector on ``ray.io/tpu-slice-name``, Ray's own selector
syntax), and ``fetch_tpu_slice_name_from_pg`` with `slice_name_of_head`, which
reads the reserved head's slice from its node label (what the bundles are then
pinned to) instead of asking a task on that host for ``TPU_NAME`` (or the GCE
metadata server). Installed where the backend installs Ray's worker order: in
the Train controller.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Mapping, Optional

import ray
import ray.util.tpu as ray_util_tpu
from ray._private.accelerators import tpu as ray_accel_tpu

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

logger = logging.getLogger(__name__)

TESTED_RAY_VERSION = C.RAY_VERSION

# Ray's own keys of a TPU host's node labels.
SLICE_NAME_LABEL = ray._raylet.RAY_NODE_TPU_SLICE_NAME_KEY
WORKER_ID_LABEL = ray._raylet.RAY_NODE_TPU_WORKER_ID_KEY
POD_TYPE_LABEL = ray._raylet.RAY_NODE_TPU_POD_TYPE_KEY
TOPOLOGY_LABEL = ray._raylet.RAY_NODE_TPU_TOPOLOGY_KEY
ACCELERATOR_TYPE_LABEL = ray._raylet.RAY_NODE_ACCELERATOR_TYPE_KEY

_ORIGINAL_RESERVE = ray_accel_tpu.reserve_tpu_slice
_ORIGINAL_FETCH = ray_accel_tpu.fetch_tpu_slice_name_from_pg


# --- the GCE metadata query -------------------------------------------------------


def answer_metadata_server(answers: Optional[Mapping[str, str]]) -> Callable[[], None]:
    """Make Ray's GCE metadata query (``_get_tpu_metadata(key)``) answer from
    `answers` (a key the server does not have: None, as Ray gets for a 404) or,
    with `answers` None, fail loudly. Returns an undo."""
    original = ray_accel_tpu._get_tpu_metadata

    def _refuse(key: str):
        raise RuntimeError(
            f"Ray tried to query the GCE metadata server for {key!r} in a simulated "
            "TPU cluster; set TPU_NAME, TPU_WORKER_ID, TPU_ACCELERATOR_TYPE and "
            "TPU_TOPOLOGY on the node, or simulate a TPU VM (simulated_tpu_cluster(tpu_vm=True))"
        )

    def _answer(key: str) -> Optional[str]:
        return answers.get(key)

    ray_accel_tpu._get_tpu_metadata = _refuse if answers is None else _answer

    def undo() -> None:
        ray_accel_tpu._get_tpu_metadata = original

    return undo


def install_simulated_metadata() -> None:
    """Ray worker setup hook of a simulated cluster with TPU VM hosts: the
    worker's host answers Ray's metadata queries from its
    ``RAY_TRAIN_TPU_SIMULATE_GCE_METADATA`` (JSON); any other host refuses them."""
    raw = _environ.get(C.RAY_TRAIN_TPU_SIMULATE_GCE_METADATA)
    answer_metadata_server(json.loads(raw) if raw else None)


# --- the slice reservation ----------------------------------------------------------


def hosts_per_slice(topology: str, accelerator_type: str) -> int:
    """Ray's count of hosts (Ray nodes) in one slice, as ``SlicePlacementGroup`` makes it."""
    version = ray_util_tpu.get_tpu_version_from_type(accelerator_type)
    chips = ray_util_tpu.get_num_chips_from_topology(topology)
    return max(1, chips // ray_util_tpu.get_chips_per_host(topology, version))


def broken_slices(nodes: Iterable[Mapping[str, Any]], pod_type: str, num_hosts: int) -> list[str]:
    """Slices of `pod_type` in a Ray node table (``ray.nodes()``) whose live hosts
    are not exactly TPU worker ids 0..num_hosts-1: a host is down, or two claim one id.

    Example:
        >>> def node(name, w, alive=True):
        ...     return {"Alive": alive, "Labels": {"ray.io/tpu-slice-name": name,
        ...             "ray.io/tpu-worker-id": str(w), "ray.io/tpu-pod-type": "v4-16"}}
        >>> broken_slices([node("a", 0), node("a", 1), node("b", 0), node("b", 1, alive=False)], "v4-16", 2)
        ['b']
    """
    seen: dict[str, list[str]] = {}
    for n in nodes:
        labels = n.get("Labels") or {}
        if not n.get("Alive") or labels.get(POD_TYPE_LABEL) != pod_type or not labels.get(SLICE_NAME_LABEL):
            continue
        seen.setdefault(labels[SLICE_NAME_LABEL], []).append(labels.get(WORKER_ID_LABEL))
    whole = sorted(str(w) for w in range(num_hosts))
    return sorted(name for name, ids in seen.items() if sorted(str(i) for i in ids) != whole)


def exclusion_selector(names: Iterable[str]) -> Optional[str]:
    """Ray's label-selector value that matches any slice name but `names` (None for none).

    Example:
        >>> exclusion_selector(["s-1", "s-0"]), exclusion_selector([])
        ('!in(s-0,s-1)', None)
    """
    names = sorted(names)
    return f"!in({','.join(names)})" if names else None


def reserve_intact_slice(topology: str, accelerator_type: str,
                         timeout_s: Optional[float] = ray_accel_tpu.DEFAULT_TPU_HEAD_RESERVATION_TIMEOUT_S,
                         slice_name: Optional[str] = None):
    """``reserve_tpu_slice`` that never reserves the head of a slice missing a host.

    With no `slice_name`, the head's label selector excludes every broken slice
    (`broken_slices` over ``ray.nodes()``): Ray then picks among the intact ones
    (and any slice that joins later, so an autoscaler still sees the demand)."""
    if slice_name is None:
        pod_type = ray_accel_tpu.infer_tpu_pod_type_from_topology(topology, accelerator_type)
        if pod_type is not None and hosts_per_slice(topology, accelerator_type) > 1:
            broken = broken_slices(ray.nodes(), pod_type, hosts_per_slice(topology, accelerator_type))
            slice_name = exclusion_selector(broken)
            if broken:
                logger.warning("ray_train_tpu: reserving a %s slice other than %s: they miss a host "
                               "(Ray's live nodes)", pod_type, ", ".join(broken))
    return _ORIGINAL_RESERVE(topology, accelerator_type, timeout_s=timeout_s, slice_name=slice_name)


def slice_name_of_head(pg) -> Optional[str]:
    """The slice of the host that holds bundle 0 of `pg` (a reserved slice head),
    from that node's ``ray.io/tpu-slice-name`` label: what Ray then pins the
    slice's bundles to. Ray's own answer where the node has no such label."""
    node_id = (ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}).get(0)
    for n in ray.nodes():
        if n.get("NodeID") == node_id and (n.get("Labels") or {}).get(SLICE_NAME_LABEL):
            return n["Labels"][SLICE_NAME_LABEL]
    return _ORIGINAL_FETCH(pg)


def install_slice_reservation() -> None:
    """Make Ray's slice reservation (``SlicePlacementGroup``) skip broken slices. Idempotent."""
    ray_util_tpu.reserve_tpu_slice = reserve_intact_slice
    ray_accel_tpu.fetch_tpu_slice_name_from_pg = slice_name_of_head


def uninstall_slice_reservation() -> None:
    """Give Ray back its own slice reservation."""
    ray_util_tpu.reserve_tpu_slice = _ORIGINAL_RESERVE
    ray_accel_tpu.fetch_tpu_slice_name_from_pg = _ORIGINAL_FETCH


def available_tpus_per_node() -> dict:
    """Free TPU of every node, by node id (Ray's ``available_resources_per_node``,
    private; what its own sub-slice search reads)."""
    from ray._private.state import available_resources_per_node

    return {node: res.get("TPU", 0) for node, res in available_resources_per_node().items()}
