"""Ray's slice reservation steered to intact slices (`_compat.ray_tpu`), on fake node
tables, through Ray 2.60's own ``reserve_tpu_slice`` and label-selector rules."""

import inspect

import pytest
import ray
import ray.util.tpu as ray_util_tpu
from ray._private.accelerators import tpu as ray_accel_tpu

from ray_train_tpu import constants as C
from ray_train_tpu._compat import ray_tpu as compat


def node(name, worker, alive=True, pod="v4-16", node_id=None):
    labels = {C.LABEL_TPU_SLICE_NAME: name, C.LABEL_TPU_WORKER_ID: str(worker), C.LABEL_TPU_POD_TYPE: pod}
    return {"NodeID": node_id or f"{name}-{worker}", "Alive": alive, "Labels": labels}


HEAD = {"NodeID": "head", "Alive": True, "Labels": {"ray.io/node-id": "head"}}


@pytest.mark.parametrize("nodes, broken", [
    ([node("a", 0), node("a", 1), node("b", 0), node("b", 1)], []),
    # one host killed hard: Ray's table keeps it, not alive
    ([node("a", 0), node("a", 1), node("b", 0), node("b", 1, alive=False)], ["b"]),
    # a host that never came back, and a slice of which only worker 1 lives
    ([node("a", 0), node("b", 0), node("b", 1), node("c", 1)], ["a", "c"]),
    # two hosts claim one id (the slice cannot gang-schedule its other id)
    ([node("a", 0), node("a", 0, node_id="x"), HEAD], ["a"]),
    # another pod type is not this reservation's business
    ([node("a", 0, pod="v4-32"), node("b", 0), node("b", 1)], []),
])
def test_broken_slices_are_those_missing_a_live_host(nodes, broken):
    assert compat.broken_slices(nodes, "v4-16", 2) == broken


@pytest.mark.parametrize("name, accel", [("2x2x1", "TPU-V4"), ("2x2x2", "TPU-V4"), ("2x2x4", "TPU-V4"),
                                         ("2x4", "TPU-V6E"), ("4x4", "TPU-V6E"), ("4x4x4", "TPU-V5P")])
def test_rays_count_of_hosts_per_slice_is_our_topology_tables(name, accel):
    from ray_train_tpu.topology import Topology

    assert compat.hosts_per_slice(name, accel) == Topology.parse(name, accel).num_hosts


def test_the_exclusion_is_a_selector_ray_accepts():
    from ray._private.label_utils import validate_label_selector_value

    selector = compat.exclusion_selector(["sim-slice-1", "ray-my-tpu-cluster-worker-aa946781-tpu"])
    assert selector == "!in(ray-my-tpu-cluster-worker-aa946781-tpu,sim-slice-1)"
    assert validate_label_selector_value(selector) is None  # Ray's own validator: no error


class _Stop(Exception):
    pass


@pytest.fixture
def head_selector(monkeypatch):
    """Run Ray's own reserve_tpu_slice up to the head's placement group and return
    the label selector it asked for."""
    seen = {}

    def placement_group(bundles, bundle_label_selector=None, **_):
        seen["bundles"], seen["selector"] = bundles, bundle_label_selector
        raise _Stop

    monkeypatch.setattr(ray_accel_tpu, "placement_group", placement_group)

    def run(nodes, **kwargs):
        monkeypatch.setattr(ray, "nodes", lambda: nodes)
        with pytest.raises(_Stop):
            compat.reserve_intact_slice("2x2x2", "TPU-V4", **kwargs)
        return seen["selector"][0]

    return run


def test_the_head_is_never_asked_of_a_broken_slice(head_selector, caplog):
    nodes = [HEAD, node("a", 0), node("a", 1, alive=False), node("b", 0), node("b", 1)]
    selector = head_selector(nodes)
    assert selector == {C.LABEL_TPU_WORKER_ID: "0", C.LABEL_TPU_POD_TYPE: "v4-16", C.LABEL_TPU_SLICE_NAME: "!in(a)"}
    assert "reserving a v4-16 slice other than a" in caplog.text


def test_without_broken_slices_or_with_a_name_ray_reserves_as_it_would(head_selector):
    intact = [node("a", 0), node("a", 1)]
    assert C.LABEL_TPU_SLICE_NAME not in head_selector(intact)
    assert head_selector(intact + [node("b", 0)], slice_name="a")[C.LABEL_TPU_SLICE_NAME] == "a"


def test_the_reserved_heads_slice_is_its_nodes_label(monkeypatch):
    monkeypatch.setattr(ray.util, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: "b-0"}})
    monkeypatch.setattr(ray, "nodes", lambda: [node("a", 0), node("b", 0)])
    assert compat.slice_name_of_head(object()) == "b"
    asked = []
    monkeypatch.setattr(compat, "_ORIGINAL_FETCH", lambda pg: asked.append(pg) or "from-ray")
    monkeypatch.setattr(ray, "nodes", lambda: [HEAD])  # no label: Ray's own answer
    assert compat.slice_name_of_head("pg") == "from-ray" and asked == ["pg"]


def test_the_seams_are_where_ray_train_reserves_and_installed_by_the_backend():
    # SlicePlacementGroup._reserve_slice calls ray.util.tpu's reserve_tpu_slice; that
    # calls the module's fetch_tpu_slice_name_from_pg and passes slice_name to the head
    assert "reserve_tpu_slice(" in inspect.getsource(ray_util_tpu.SlicePlacementGroup._reserve_slice)
    assert ray_util_tpu.SlicePlacementGroup._reserve_slice.__globals__ is vars(ray_util_tpu)
    source = inspect.getsource(compat._ORIGINAL_RESERVE)
    assert "fetch_tpu_slice_name_from_pg(head_placement_group)" in source
    assert "head_label_selector[ray._raylet.RAY_NODE_TPU_SLICE_NAME_KEY] = slice_name" in source
    import ray_train_tpu._backend  # noqa: F401  (installs, as in the Train controller)

    try:
        assert ray_util_tpu.reserve_tpu_slice is compat.reserve_intact_slice
        assert ray_accel_tpu.fetch_tpu_slice_name_from_pg is compat.slice_name_of_head
    finally:
        compat.uninstall_slice_reservation()
    assert ray_util_tpu.reserve_tpu_slice is ray_accel_tpu.reserve_tpu_slice
    compat.install_slice_reservation()  # as the backend left it
