"""launch_env: the per-worker TorchTPU environment, and its invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_train_tpu.cli.plan import build_plan, worker_env
from ray_train_tpu.launch_env import (
    ENV_KEYS,
    MEGASCALE_KEYS,
    check_override,
    reconcile,
    launch_env,
    launch_envs,
    placeholder_hosts,
    rank_of,
    worker_place,
)
from ray_train_tpu.topology import GENERATIONS, Topology


def _hosts(t, num_slices=1):
    return [f"10.{s}.0.{w}" for s in range(num_slices) for w in range(t.num_hosts)]


def test_v4_2x2x2_matches_torch_tpu_example():
    t = Topology.parse("2x2x2", "TPU-V4")
    env = launch_env(t, ["h0", "h1"], rank=5, xprof_session_id="42")
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "NODE_RANK": "1",
        "NNODES": "2",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29500",
        "TPU_VISIBLE_CHIPS": "1",
        "TPU_HOST_BOUNDS": "2,2,2",  # torch_tpu's per-process view: a mesh of one-chip processes
        "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": "2,2,2",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "h0,h1",
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": "h0:8070,h0:8071,h0:8072,h0:8073,h1:8070,h1:8071,h1:8072,h1:8073",
        "TORCH_TPU_TOPOLOGY": "2,2,2",
        "TORCH_TPU_XPROF_SESSION_ID": "42",
    }


def test_multislice_sets_megascale_like_ray():
    from ray.util.tpu import get_tpu_coordinator_env_vars

    t = Topology.parse("2x2x2", "TPU-V4")
    hosts = _hosts(t, 2)
    env = launch_env(t, hosts, rank=13, num_slices=2, xprof_session_id="1")
    assert env["RANK"] == "13" and env["WORLD_SIZE"] == "16"
    assert env["NODE_RANK"] == "3" and env["NNODES"] == "4" and env["TPU_WORKER_ID"] == "1"
    assert env["TPU_WORKER_HOSTNAMES"] == "10.1.0.0,10.1.0.1"
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[5] == "10.1.0.1:8071"
    ray_env = get_tpu_coordinator_env_vars(
        coordinator_address="10.0.0.0:8080", num_slices=2, slice_id=1, coordinator_port="8080"
    )
    for key in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"):
        assert env[key] == ray_env[key]
    # torch_tpu's ports (it sets them at PJRT start): 8080 + 2 * LOCAL_RANK and the debug port next to it
    assert (env["MEGASCALE_PORT"], env["MEGASCALE_DEBUG_PORT"]) == (str(8080 + 2), str(8081 + 2))
    single = launch_env(t, hosts[:2], rank=5, xprof_session_id="1")
    assert not set(MEGASCALE_KEYS) & set(single)


def test_v7x_local_rank_is_a_core_and_chip_is_shared():
    t = Topology.parse("2x2x2", "TPU-V7X")
    envs = launch_envs(t, ["a", "b"], xprof_session_id="1")
    assert len(envs) == 16
    place, env = envs[11]
    assert (place.worker_id, place.local_rank, place.chip) == (1, 3, 1)
    # torch_tpu masks one device per process: TPU_VISIBLE_CHIPS is the TensorCore (LOCAL_RANK),
    # not Ray's physical chip (1), and a process holds one core of a chip
    assert env["TPU_VISIBLE_CHIPS"] == "3" and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1,1"
    assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "2,2,2,2"
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[11] == "b:8073"
    assert env["TORCH_TPU_TOPOLOGY"] == "2,2,2,2"


def test_ports_and_session_id_are_configurable():
    t = Topology.parse("2x2", "TPU-V6E")
    env = launch_env(t, ["h"], rank=3, xprof_session_id="s", base_port=9000, master_port=1234)
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "h:9000,h:9001,h:9002,h:9003"
    assert env["MASTER_PORT"] == "1234" and env["TORCH_TPU_XPROF_SESSION_ID"] == "s"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hosts=["h0"]), "must list the 2 hosts"),
        (dict(hosts=["h0", "h0"]), "repeated: h0"),
        (dict(hosts=["h0", "h,1"]), "contain no ','"),
        (dict(hosts="h0,h1"), "must list the 2 hosts"),
        (dict(rank=8), "rank 8 is outside"),
        (dict(base_port=65534), "base_port must be"),
        (dict(num_slices=0), "num_slices must be"),
        (dict(xprof_session_id=""), "xprof_session_id"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(kwargs, match):
    t = Topology.parse("2x2x2", "TPU-V4")
    args = dict(hosts=["h0", "h1"], rank=0, xprof_session_id="1") | kwargs
    hosts = args.pop("hosts")
    with pytest.raises(ValueError, match=match):
        launch_env(t, hosts, **args)


def test_reconcile_replaces_host_values_and_removes_stale_job_variables():
    computed = {"MASTER_PORT": "29500", "RANK": "3", "TPU_VISIBLE_CHIPS": "3"}
    plan = reconcile(computed, {"MASTER_PORT": "1111", "TPU_VISIBLE_CHIPS": "3", "OTHER": "x",
                                "MEGASCALE_NUM_SLICES": "4"}, {})
    assert plan.env == computed
    assert plan.replaced == {"MASTER_PORT": ("1111", "29500")}
    assert plan.unset == ("MEGASCALE_NUM_SLICES",)  # a job variable; OTHER is not ours to touch


_V4 = Topology.parse("2x2x2", "TPU-V4")
_HOSTS = ["10.0.0.1", "10.0.0.2"]


def _override_ok(rank, **extra):
    place, env = launch_envs(_V4, _HOSTS, xprof_session_id="1")[rank]
    env = {**env, **extra}
    check_override(env, place, _V4, _HOSTS[place.node_rank], 1)


@pytest.mark.parametrize("key, value, rule", [
    ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "10.0.0.1:8471,10.0.0.2:8471", "one address per device: 8"),
    ("TORCH_TPU_SLICEBUILDER_ADDRESSES", ",".join(f"10.0.0.1:{8070 + i}" for i in range(8)), "at index 5"),
    ("TPU_WORKER_HOSTNAMES", "a,b,c", "the slice's 2 hosts"),
    ("TORCH_TPU_TOPOLOGY", "4,4,1", "8-chip slice"),
    ("TORCH_TPU_TOPOLOGY", "big", "8-chip slice"),
    ("MEGASCALE_NUM_SLICES", "2", "must be 1"),
])
def test_an_override_that_cannot_describe_the_slice_is_refused_by_name(key, value, rule):
    with pytest.raises(ValueError, match=rule) as e:
        _override_ok(5, **{key: value})
    assert key in str(e.value) and "extra_env" in str(e.value)


def test_consistent_overrides_pass():
    # Webhook-style ports and DNS names given consistently with TPU_WORKER_HOSTNAMES.
    names = ["w-0.svc", "w-1.svc"]
    addresses = ",".join(f"{h}:{8471 + i}" for h in names for i in range(4))
    for rank in range(8):
        _override_ok(rank, TORCH_TPU_SLICEBUILDER_ADDRESSES=addresses, TPU_WORKER_HOSTNAMES=",".join(names),
                     TORCH_TPU_TOPOLOGY="2x2x2")


_cases = st.sampled_from(
    [(g, t) for g in GENERATIONS for t in sorted(GENERATIONS[g].topologies)
     if Topology.parse(t, g).num_devices <= 512]
)


@settings(max_examples=60, deadline=None)
@given(_cases, st.integers(1, 3), st.integers(1024, 60000))
def test_invariants_for_every_rank(case, num_slices, base_port):
    accel, name = case
    t = Topology.parse(name, accel)
    hosts = _hosts(t, num_slices)
    envs = launch_envs(t, hosts, num_slices=num_slices, xprof_session_id="7", base_port=base_port)
    world = t.num_devices * num_slices
    assert [p.rank for p, _ in envs] == list(range(world))  # 0..N-1 once each
    for place, env in envs:
        assert set(env) == set(ENV_KEYS) | (set(MEGASCALE_KEYS) if num_slices > 1 else set())
        assert env["RANK"] == str(place.rank) and env["WORLD_SIZE"] == str(world)
        # rank = node_rank * devices_per_host + local_rank, slice-major
        assert place.rank == place.node_rank * t.devices_per_host + place.local_rank
        assert rank_of(t, slice_id=place.slice_id, worker_id=place.worker_id, local_rank=place.local_rank) == place.rank
        # node ranks follow TPU worker ids within a slice
        assert env["TPU_WORKER_ID"] == str(place.worker_id)
        assert place.node_rank == place.slice_id * t.num_hosts + place.worker_id
        # the rank's own address is on its own host, at base + LOCAL_RANK
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        own = addresses[place.rank - place.slice_id * t.num_devices]
        assert own == f"{hosts[place.node_rank]}:{base_port + place.local_rank}"
        assert len(addresses) == t.num_devices == len(set(addresses))
        # the chip is on this host
        assert t.host_of_chip(place.chip_coords) == place.worker_id
    # the address list is identical for all ranks of a slice
    for s in range(num_slices):
        lists = {env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] for p, env in envs if p.slice_id == s}
        assert len(lists) == 1


def test_launch_env_and_launch_envs_agree():
    t = Topology.parse("4x4", "TPU-V6E")
    hosts = _hosts(t)
    for place, env in launch_envs(t, hosts, xprof_session_id="9"):
        assert env == launch_env(t, hosts, rank=place.rank, xprof_session_id="9")
        assert place == worker_place(t, place.rank)


def test_build_plan_shape():
    t = Topology.parse("4x4", "TPU-V6E")
    plan = build_plan(t, num_slices=2)
    assert plan["num_workers"] == 32 and plan["num_hosts"] == 4 and plan["pod_type"] == "v6e-16"
    assert [w["rank"] for w in plan["workers"]] == list(range(32))
    w = plan["workers"][21]
    assert (w["slice_id"], w["worker_id"], w["local_rank"], w["node_rank"]) == (1, 1, 1, 5)
    assert w["host"] == placeholder_hosts(t, 2)[5] == worker_env(plan, 21)["TPU_WORKER_HOSTNAMES"].split(",")[1]
    assert w["chip_coords"] == [3, 0, 0]


# --- libtpu's views and the worker-environment statement (issue 25) ---------------------------

from ray_train_tpu.launch_env import coords_query_env, host_view_env, process_view_env  # noqa: E402
from ray_train_tpu.testing.worker_env import OURS, statement  # noqa: E402

JOBS = [("2x2x2", "TPU-V4", 1), ("4x4", "TPU-V6E", 1), ("2x4", "TPU-V6E", 1), ("2x2x4", "TPU-V5P", 1),
        ("2x2x1", "TPU-V7X", 1), ("2x2x2", "TPU-V7X", 1), ("2x2x2", "TPU-V4", 2), ("2x2x1", "TPU-V4", 3)]


@pytest.mark.parametrize("name, accel, num_slices", JOBS)
def test_launch_env_is_the_statement_for_every_rank(name, accel, num_slices):
    """launch_env sets exactly the variables the statement says we set, with its
    values (written from the upstream conventions, not from launch_env)."""
    t = Topology.parse(name, accel)
    hosts = _hosts(t, num_slices)
    for place, env in launch_envs(t, hosts, num_slices=num_slices, xprof_session_id="7", master_port=1234):
        stated = statement(t, hosts, rank=place.rank, master_port=1234, session="7", host_env={},
                           num_slices=num_slices)
        ours = {k: v.value for k, v in stated.items() if v.set_by.startswith(OURS) and v.value is not None}
        assert env == ours, (place.rank, set(env.items()) ^ set(ours.items()))


@pytest.mark.parametrize("name, accel", [(n, a) for n, a, _ in JOBS])
def test_host_view_is_rays_and_gkes_host(name, accel):
    """The whole-host view (for the coordinate query): as many hosts as Ray's
    worker grid, as many chips per host as Ray's table (ray._private.accelerators.tpu)."""
    from ray._private.accelerators.tpu import _get_worker_dims_for_topology, get_chips_per_host

    t = Topology.parse(name, accel)
    view = host_view_env(t)
    grid = [int(x) for x in view["TPU_HOST_BOUNDS"].split(",")]
    chips = [int(x) for x in view["TPU_CHIPS_PER_HOST_BOUNDS"].split(",")]
    assert chips[0] * chips[1] * chips[2] == t.chips_per_host == get_chips_per_host(t.name, t.generation.pod_prefix)
    if t.chips_per_host == 4:  # Ray's worker grid assumes 4-chip hosts (v6e 2x4 is one 8-chip host)
        workers = 1
        for d in _get_worker_dims_for_topology(t.name):
            workers *= d
        assert grid[0] * grid[1] * grid[2] == t.num_hosts == workers
    assert [g * c for g, c in zip(grid, chips)] == list(t.bounds)


def test_process_view_is_one_device_per_process():
    t = Topology.parse("2x2x2", "TPU-V7X")
    assert process_view_env(t, 7) == {"TPU_VISIBLE_CHIPS": "7", "TPU_HOST_BOUNDS": "2,2,2,2",
                                      "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1,1", "TPU_PROCESS_BOUNDS": "2,2,2,2",
                                      "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1,1"}


def test_the_coordinate_query_env_describes_the_host_not_the_process():
    t = Topology.parse("4x4", "TPU-V6E")
    worker = launch_env(t, _hosts(t), rank=6, xprof_session_id="1")
    env = coords_query_env({**worker, "TPU_VISIBLE_DEVICES": "2", "CLOUD_TPU_TASK_ID": "6", "PATH": "/bin"}, t)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPU_VISIBLE_CHIPS", "TPU_VISIBLE_DEVICES",
                "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "CLOUD_TPU_TASK_ID"):
        assert key not in env, key  # torch_tpu would start a multi-process client, libtpu a one-chip one
    assert (env["TPU_HOST_BOUNDS"], env["TPU_CHIPS_PER_HOST_BOUNDS"]) == ("2,2,1", "2,2,1")
    assert env["PATH"] == "/bin" and env["TPU_WORKER_HOSTNAMES"] == worker["TPU_WORKER_HOSTNAMES"]


def test_the_platforms_values_are_replaced_without_a_warning():
    computed = {"TPU_HOST_BOUNDS": "2,2,2", "TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2", "MASTER_PORT": "29500"}
    preset = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc", "MASTER_PORT": "1"}
    plan = reconcile(computed, preset, {})
    assert plan.env == computed and set(plan.replaced) == {"MASTER_PORT"}  # Ray's and GKE's: by design
