"""mesh_layout: the device mesh of a job, its invariants and its errors.

The invariants are checked against `launch_env.worker_place`, the function
that decides which host and slice each rank runs on, so the mesh and the
launch cannot drift apart.
"""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_train_tpu.launch_env import worker_place
from ray_train_tpu.mesh import DIM_NAMES, MeshLayout, build_device_mesh, mesh_layout, mesh_layout_for
from ray_train_tpu.topology import GENERATIONS, Topology

# Slices up to 64 devices: enough hosts to matter, small enough to enumerate every rank.
SLICES = sorted(
    (name, acc)
    for acc, gen in GENERATIONS.items()
    for name in gen.topologies
    if Topology.parse(name, acc).num_devices <= 64
)


def groups(layout: MeshLayout, dim: str) -> list[list[int]]:
    """The rank groups along `dim` of a row-major mesh (what init_device_mesh builds)."""
    axis = layout.dim_names.index(dim)
    strides = [1] * len(layout.shape)
    for i in range(len(layout.shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * layout.shape[i + 1]
    others = [range(n) if i != axis else range(1) for i, n in enumerate(layout.shape)]
    out = []
    for coord in itertools.product(*others):
        base = sum(c * s for c, s in zip(coord, strides))
        out.append([base + k * strides[axis] for k in range(layout.shape[axis])])
    return out


@st.composite
def jobs(draw):
    name, acc = draw(st.sampled_from(SLICES))
    topology = Topology.parse(name, acc)
    num_slices = draw(st.integers(1, 3))
    per_host = topology.devices_per_host
    tp_size = draw(st.sampled_from([d for d in range(1, per_host + 1) if per_host % d == 0]))
    return topology, num_slices, tp_size, draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_every_mesh_fits_the_job(job):
    topology, num_slices, tp_size, fsdp = job
    layout = mesh_layout_for(topology, num_slices=num_slices, tp_size=tp_size, fsdp=fsdp)
    world_size = topology.num_devices * num_slices
    assert layout.dim_names == DIM_NAMES
    assert layout.world_size == world_size
    assert layout.size("tp") == tp_size
    places = [worker_place(topology, r, num_slices) for r in range(world_size)]
    # Each tp group is consecutive ranks on one host: neighbouring chips, ICI only.
    for group in groups(layout, "tp"):
        assert group == list(range(group[0], group[0] + tp_size))
        assert len({(places[r].slice_id, places[r].worker_id) for r in group}) == 1
    # Slices are outermost: with FSDP, only dp_replicate crosses slices (DCN).
    for group in groups(layout, "dp_shard"):
        assert len({places[r].slice_id for r in group}) == 1
    if fsdp:
        assert layout.size("dp_replicate") == num_slices
        for group in groups(layout, "dp_replicate"):
            assert sorted(places[r].slice_id for r in group) == list(range(num_slices))
    else:
        assert layout.size("dp_shard") == 1


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(1, 64),
    tp_size=st.integers(1, 9),
    num_slices=st.integers(1, 5),
    devices_per_host=st.one_of(st.none(), st.sampled_from([1, 2, 4, 8])),
    fsdp=st.booleans(),
)
def test_any_request_is_laid_out_or_refused_by_name(world_size, tp_size, num_slices, devices_per_host, fsdp):
    try:
        layout = mesh_layout(world_size, tp_size=tp_size, num_slices=num_slices, devices_per_host=devices_per_host, fsdp=fsdp)
    except ValueError as e:
        assert str(e).startswith(("tp_size=", "world_size ")), e
        assert "; use " in str(e), e  # every refusal names a fix
        return
    assert layout.world_size == world_size
    assert world_size % (num_slices * tp_size) == 0
    assert devices_per_host is None or devices_per_host % tp_size == 0
    for group in groups(layout, "tp"):  # consecutive ranks, inside one host
        assert devices_per_host is None or len({r // devices_per_host for r in group}) == 1


def test_examples():
    assert mesh_layout(8) == MeshLayout(shape=(1, 8, 1), dim_names=DIM_NAMES)
    assert mesh_layout(8, fsdp=False).shape == (8, 1, 1)
    assert mesh_layout(16, tp_size=2, num_slices=2, devices_per_host=4).shape == (2, 4, 2)
    assert mesh_layout(16, tp_size=2, num_slices=2, fsdp=False).shape == (8, 1, 2)
    assert mesh_layout(1).shape == (1, 1, 1)
    v7 = Topology.parse("2x2x2", "TPU-V7X")  # 2 devices per chip, 8 per host
    assert mesh_layout_for(v7, tp_size=8).shape == (1, 2, 8)


def test_tp_size_must_divide_devices_per_host():
    with pytest.raises(ValueError, match=r"^tp_size=3 does not divide the 4 devices per host of TPU-V4 2x2x2 \(v4-16\); use 1, 2 or 4$"):
        mesh_layout_for(Topology.parse("2x2x2", "TPU-V4"), tp_size=3)
    with pytest.raises(ValueError, match=r"^tp_size=8 does not divide the 4 devices per host; use 1, 2 or 4$"):
        mesh_layout(16, tp_size=8, devices_per_host=4)


def test_world_size_must_split_into_slices_and_tp_groups():
    with pytest.raises(ValueError, match=r"^world_size 8 is not a multiple of num_slices=3: .*use num_slices 1, 2, 4 or 8$"):
        mesh_layout(8, num_slices=3)
    with pytest.raises(ValueError, match=r"^world_size 8 is not a multiple of num_slices \* tp_size = 2 \* 3: .*use tp_size 1, 2 or 4$"):
        mesh_layout(8, tp_size=3, num_slices=2)


@pytest.mark.parametrize("field, kwargs", [
    ("world_size", {"world_size": 0}),
    ("tp_size", {"world_size": 4, "tp_size": 0}),
    ("num_slices", {"world_size": 4, "num_slices": True}),
    ("devices_per_host", {"world_size": 4, "devices_per_host": 2.0}),
])
def test_counts_must_be_positive_integers(field, kwargs):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=rf"^{field} must be an integer >= 1, got"):
        mesh_layout(world_size, **kwargs)


def test_layout_rejects_mismatched_names():
    with pytest.raises(ValueError, match="one name per dimension"):
        MeshLayout(shape=(2, 2), dim_names=("dp",))
    with pytest.raises(ValueError, match="repeats a name"):
        MeshLayout(shape=(2, 2), dim_names=("dp", "dp"))
    assert MeshLayout(shape=(2, 2), dim_names=("dp", "tp")).size("cp") == 1


def test_build_device_mesh_checks_the_process_group(monkeypatch):
    import torch.distributed as dist

    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        build_device_mesh(mesh_layout(2), "cpu")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # a one-rank group: in-process store, loopback only
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"has 2 ranks but the process group has 1; the product of the mesh"):
            build_device_mesh(mesh_layout(2), "cpu")
        mesh = build_device_mesh(mesh_layout(1), "cpu")
        assert mesh.mesh_dim_names == DIM_NAMES and mesh.mesh.tolist() == [[[0]]]
    finally:
        dist.destroy_process_group()


# --- data-parallel ranks: which ranks read the same batch --------------------

@settings(max_examples=200, deadline=None)
@given(jobs())
def test_data_parallel_ranks_split_tp_groups_apart_and_keep_their_members_together(job):
    """Ranks of one ``tp`` group share a data-parallel rank; different groups
    have different ones, numbered 0..dp_size-1 (checked against `groups`, the
    row-major rank groups of init_device_mesh)."""
    topology, num_slices, tp_size, fsdp = job
    layout = mesh_layout_for(topology, num_slices=num_slices, tp_size=tp_size, fsdp=fsdp)
    dp = [layout.data_parallel(r) for r in range(layout.world_size)]
    assert {size for _, size in dp} == {layout.world_size // tp_size}
    tp_groups = groups(layout, "tp")
    assert all(len({dp[r][0] for r in g}) == 1 for g in tp_groups)
    assert sorted(dp[g[0]][0] for g in tp_groups) == list(range(len(tp_groups)))


@pytest.mark.parametrize("shape, names", [
    ((2, 2, 2), DIM_NAMES), ((1, 4, 2), DIM_NAMES), ((4, 1, 1), DIM_NAMES), ((1, 1, 4), DIM_NAMES),
    ((2, 3), ("tp", "dp_shard")),  # a user's ModelParallelStrategy mesh: dp need not be outermost
])
def test_data_parallel_ranks_match_torchs_device_mesh(shape, names):
    """`MeshLayout.data_parallel` against torch's own ``init_device_mesh`` (on
    torch's fake process group): the same coordinates for every rank, and the
    peers that share a data-parallel rank are exactly the ranks of torch's
    sub-mesh over the other dimensions."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout = MeshLayout(shape=shape, dim_names=names)
    others = tuple(n for n in names if not n.startswith("dp"))
    for rank in range(layout.world_size):
        dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            dp_rank, dp_size = layout.data_parallel(rank)
            peers = set(mesh[others].mesh.flatten().tolist()) if others else {rank}
            coords = dict(zip(names, mesh.get_coordinate()))
        finally:
            dist.destroy_process_group()
        assert {r for r in range(layout.world_size) if layout.data_parallel(r)[0] == dp_rank} == peers
        dp_names = [n for n in names if n.startswith("dp")]
        want = 0
        for n in dp_names:
            want = want * layout.size(n) + coords[n]
        assert (dp_rank, dp_size) == (want, layout.world_size // max(1, len(peers)))


def test_data_parallel_rejects_a_rank_outside_the_mesh():
    with pytest.raises(ValueError, match=r"rank=8 is not a rank of mesh .*ranks are 0..7"):
        mesh_layout(8, tp_size=2).data_parallel(8)
