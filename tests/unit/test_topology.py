"""Topology parsing and per-generation facts."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_train_tpu.topology import GENERATIONS, Topology, get_generation, valid_topologies


@pytest.mark.parametrize(
    "text, accel, chips, hosts, per_host, pod_type",
    [
        ("4x4", "TPU-V6E", 16, 4, 4, "v6e-16"),
        ("4X4", "TPU-V6E", 16, 4, 4, "v6e-16"),
        ("2x4", "TPU-V6E", 8, 1, 8, "v6e-8"),
        ("1x1", "TPU-V6E", 1, 1, 1, "v6e-1"),
        ("16x16", "TPU-V6E", 256, 64, 4, "v6e-256"),
        ("2x2x2", "TPU-V4", 8, 2, 4, "v4-16"),
        ("2,2,1", "TPU-V4", 4, 1, 4, "v4-8"),
        ("2x2x4", "TPU-V4", 16, 4, 4, "v4-32"),
        ("16x16x16", "TPU-V4", 4096, 1024, 4, "v4-8192"),
        ("4x4x4", "TPU-V5P", 64, 16, 4, "v5p-128"),
        ("2x4", "TPU-V5LITEPOD", 8, 1, 8, "v5litepod-8"),
        ("8x16", "v5e", 128, 32, 4, "v5litepod-128"),
        ("2x2x1", "TPU-V7X", 4, 1, 4, "v7x-8"),
        ("2,2,2,2", "TPU-V7X", 8, 2, 4, "v7x-16"),
    ],
)
def test_parse_sizes_and_pod_type(text, accel, chips, hosts, per_host, pod_type):
    t = Topology.parse(text, accelerator_type=accel)
    assert (t.num_chips, t.num_hosts, t.chips_per_host, t.pod_type) == (chips, hosts, per_host, pod_type)


def test_v7x_worker_is_a_tensorcore():
    t = Topology.parse("2x2x2", "TPU-V7X")
    assert t.devices_per_chip == 2
    assert t.num_devices == 16 and t.devices_per_host == 8
    assert t.torch_tpu_topology == "2,2,2,2"
    assert Topology.parse("2x2x2", "TPU-V4").torch_tpu_topology == "2,2,2"


@pytest.mark.parametrize(
    "text, accel",
    [("4x5", "TPU-V6E"), ("2x2x2", "TPU-V6E"), ("4x4", "TPU-V4"), ("", "TPU-V6E"),
     ("4x4x", "TPU-V6E"), ("-4x4", "TPU-V6E"), ("2,2,1,2", "TPU-V4"), ("32x32x32", "TPU-V4")],
)
def test_bad_topology_lists_valid_ones(text, accel):
    with pytest.raises(ValueError) as e:
        Topology.parse(text, accelerator_type=accel)
    msg = str(e.value)
    assert repr(text) in msg and get_generation(accel).accelerator_type in msg
    assert "valid: " + ", ".join(valid_topologies(accel)) in msg


def test_bad_accelerator_type_lists_generations():
    with pytest.raises(ValueError, match="TPU-V4, TPU-V5P, TPU-V5LITEPOD, TPU-V6E, TPU-V7X"):
        Topology.parse("4x4", accelerator_type="TPU-V9")


def test_host_order_matches_torch_tpu_convention():
    # torch_tpu: hosts = product of (M // C) ranges, sorted with key h[::-1].
    t = Topology.parse("4x4x8", "TPU-V4")
    grid = (2, 2, 8)
    expected = sorted(itertools.product(*(range(n) for n in grid)), key=lambda h: h[::-1])
    assert list(t.host_coords) == expected
    assert t.host_coords[1] == (1, 0, 0)  # X is minor


def test_chip_coords_are_a_bijection_onto_the_mesh():
    t = Topology.parse("4x8", "TPU-V6E")
    coords = [t.chip_coords(w, c) for w in range(t.num_hosts) for c in range(t.chips_per_host)]
    mesh = {(x, y, 0) for x in range(4) for y in range(8)}
    assert set(coords) == mesh and len(coords) == len(mesh)
    for w in range(t.num_hosts):
        for c in range(t.chips_per_host):
            assert t.host_of_chip(t.chip_coords(w, c)) == w


def test_chip_coords_rejects_out_of_range():
    t = Topology.parse("2x2x2", "TPU-V4")
    with pytest.raises(ValueError, match="worker_id 2"):
        t.chip_coords(2, 0)
    with pytest.raises(ValueError, match="local_index 4"):
        t.chip_coords(0, 4)


_any_topology = st.sampled_from(
    [(g, t) for g in GENERATIONS for t in sorted(GENERATIONS[g].topologies)]
)


@settings(max_examples=150, deadline=None)
@given(_any_topology)
def test_every_valid_topology_tiles_hosts_exactly(case):
    accel, text = case
    t = Topology.parse(text, accel)
    assert t.num_hosts * t.chips_per_host == t.num_chips
    assert len(set(t.host_coords)) == t.num_hosts
    assert t.chips_per_host <= 8
    # a canonical name parses to itself, and the comma form is equivalent
    assert Topology.parse(t.name, accel) == t
    assert Topology.parse(text.replace("x", ","), accel) == t


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), st.sampled_from(sorted(GENERATIONS)))
def test_random_strings_raise_only_a_useful_value_error(text, accel):
    try:
        t = Topology.parse(text, accel)
    except ValueError as e:
        assert "valid: " in str(e)
    else:
        assert t.name in GENERATIONS[accel].topologies


def test_matches_rays_own_tpu_tables():
    """Pod types and chips per host agree with Ray's helpers for every slice Ray knows."""
    from ray._private.accelerators import tpu as ray_tpu

    for accel, gen in GENERATIONS.items():
        ray_valid = ray_tpu.VALID_TPU_TOPOLOGY[gen.pod_prefix]
        for name in sorted(gen.topologies & ray_valid):
            t = Topology.parse(name, accel)
            assert t.pod_type == ray_tpu.infer_tpu_pod_type_from_topology(name, accel)
            assert t.chips_per_host == ray_tpu.get_chips_per_host(name, gen.pod_prefix), (accel, name)
