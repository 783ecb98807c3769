"""Host order from physical chip coordinates (issue 17, part 2).

`order_slice_hosts` must give every host the NODE_RANK that torch_tpu's own
launcher derives from its chip coordinates, whatever TPU_WORKER_ID says
(shuffled, repeated or missing, as GKE has handed out), and must name every
host whose id it overrules. Without coordinates for every host, TPU_WORKER_ID
order stays. The reference is torch_tpu's ``_calculate_topological_node_rank``
and ``_get_slice_host_coordinates``, run as shipped in a child process (as
test_torch_tpu_conformance.py runs its launcher).
"""

import json
import os
import re
import subprocess
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_train_tpu._compat import ray_train as compat_ray
from ray_train_tpu.discovery import WorkerInfo, layout, order_slice_hosts
from ray_train_tpu.topology import Topology

SLICES = [("2x2x4", "TPU-V4"), ("4x4", "TPU-V6E"), ("4x4x4", "TPU-V4"), ("8x16", "TPU-V6E"), ("2x2x2", "TPU-V7X")]


def _chips(t):
    return [t.chip_coords(w, c) for w in range(t.num_hosts) for c in range(t.chips_per_host)]


@pytest.fixture(scope="module")
def torch_tpu_node_ranks():
    """torch_tpu's NODE_RANK of every chip of every slice, and its host order."""
    import torch_tpu  # noqa: F401  (the [tpu] extra, which make test installs: never skipped)
    cases = {}
    for name, accel in SLICES:
        t = Topology.parse(name, accel)
        cases[t.torch_tpu_topology] = [list(c) for c in _chips(t)]
    code = (
        "import json, sys\n"
        "from torch_tpu._internal.distributed import distributed as d\n"
        "cases = json.loads(sys.argv[1])\n"
        "out = {t: {'hosts': d._get_slice_host_coordinates(t),\n"
        "           'ranks': [d._calculate_topological_node_rank(c, t) for c in chips]}\n"
        "       for t, chips in cases.items()}\n"
        "print('RANKS=' + json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_TPU_", "TPU_", "NODE_RANK", "JOB_COMPLETION"))}
    env.update({"TPU_SKIP_MDS_QUERY": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=240, check=True).stdout
    theirs = json.loads(next(l for l in out.splitlines() if l.startswith("RANKS=")).removeprefix("RANKS="))
    table = {}
    for name, accel in SLICES:
        t = Topology.parse(name, accel)
        mine = theirs[t.torch_tpu_topology]
        table[(name, accel)] = ({tuple(c): r for c, r in zip(_chips(t), mine["ranks"])},
                                [tuple(h) for h in mine["hosts"]])
    return table


def _ip(host):
    return f"10.1.{host // 250}.{host % 250 + 1}"


def _infos(t, worker_ids, chip_of, order):
    """Workers of one slice whose host at grid position p has IP _ip(p) and
    TPU_WORKER_ID worker_ids[p]; each worker reports the coordinates of its own chip."""
    infos = []
    for p in range(t.num_hosts):
        for d in range(t.devices_per_host):
            chip = chip_of(p, d)
            infos.append(dict(node_ip=_ip(p), slice_name="s", tpu_worker_id=worker_ids[p], tpu_ids=(d,),
                              node_tpus=t.devices_per_host, chip_coords=chip))
    return [WorkerInfo(index=i, **infos[j]) for i, j in enumerate(order)]


@st.composite
def _slice_with_bad_ids(draw):
    """A slice, a shuffled assignment of TPU_WORKER_IDs with some repeated or
    missing, and a shuffled arrival order of its workers."""
    case = draw(st.sampled_from(SLICES))
    t = Topology.parse(*case)
    ids = draw(st.permutations(range(t.num_hosts)))
    ids = list(ids)
    for p in draw(st.lists(st.integers(0, t.num_hosts - 1), max_size=3)):
        ids[p] = draw(st.sampled_from([None, ids[(p + 1) % t.num_hosts]]))  # missing, or another host's id
    order = draw(st.permutations(range(t.num_devices)))
    return case, t, ids, list(order)


@settings(max_examples=60, deadline=None)
@given(_slice_with_bad_ids())
def test_ranks_follow_torch_tpu_coordinates_whatever_the_worker_ids(torch_tpu_node_ranks, drawn):
    case, t, ids, order = drawn
    node_rank_of_chip, _ = torch_tpu_node_ranks[case]

    def chip_of(p, d):
        return t.chip_coords(p, d // t.devices_per_chip)

    infos = _infos(t, ids, chip_of, order)
    out = layout(infos, t, 1)
    honest = layout(_infos(t, list(range(t.num_hosts)), chip_of, order), t, 1)
    assert out.ranks == honest.ranks  # the worker ids do not matter, the coordinates do
    for info, rank in zip(infos, out.ranks):
        node_rank = rank // t.devices_per_host
        assert node_rank == node_rank_of_chip[info.chip_coords]  # torch_tpu's NODE_RANK for that chip
        assert out.hosts[node_rank] == info.node_ip
        assert rank % t.devices_per_host == info.tpu_ids[0]
    # every host whose TPU_WORKER_ID is missing, repeated or off is named, with both values
    named = {w.split()[1] for w in out.warnings}
    counts = {i: ids.count(i) for i in ids}
    bad = {_ip(p) for p in range(t.num_hosts) if ids[p] is None or counts[ids[p]] > 1 or ids[p] != p}
    assert named == bad
    for warning in out.warnings:
        p = next(p for p in range(t.num_hosts) if f"host {_ip(p)} " in warning)
        assert f"position {p} " in warning
        assert ("has no TPU_WORKER_ID" if ids[p] is None else f"TPU_WORKER_ID={ids[p]}") in warning
    assert not out.notes and not honest.warnings


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SLICES), st.randoms())
def test_host_order_is_torch_tpus(torch_tpu_node_ranks, case, rnd):
    """Hosts listed in any order with any of their chips: positions are the
    index in torch_tpu's `_get_slice_host_coordinates` order."""
    t = Topology.parse(*case)
    _, their_hosts = torch_tpu_node_ranks[case]
    claims = [(f"h{h}", rnd.choice([None, 7]), tuple(c * b + rnd.randrange(b) for c, b in zip(h, (2, 2, 1))))
              for h in their_hosts]
    rnd.shuffle(claims)
    got = order_slice_hosts("s", claims)
    assert got.by_coords
    assert {ip: p for ip, p in got.positions.items()} == {f"h{h}": i for i, h in enumerate(their_hosts)}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SLICES[:3]), st.data())
def test_without_coordinates_for_every_host_worker_ids_stay(case, data):
    t = Topology.parse(*case)
    hosts = list(range(t.num_hosts))
    without = set(data.draw(st.lists(st.sampled_from(hosts), min_size=1, unique=True)))
    ids = data.draw(st.permutations(hosts))
    claims = [(_ip(p), ids[p], None if p in without else t.chip_coords(p, 0)) for p in hosts]
    got = order_slice_hosts("s", claims)
    assert not got.by_coords
    assert got.positions == {_ip(p): ids[p] for p in hosts}
    if len(without) == len(hosts):  # one line for the slice, none per host
        assert got.note and "no host reports TPU chip coordinates" in got.note and not got.warnings
    else:
        assert got.note is None and len(got.warnings) == 1
        assert all(_ip(p) in got.warnings[0] for p in without)
    infos = _infos(t, list(ids), lambda p, d: None if p in without else t.chip_coords(p, d // t.devices_per_chip),
                   range(t.num_devices))
    out = layout(infos, t, 1)
    assert out.hosts == [_ip(ids.index(w)) for w in hosts]


def test_coordinates_that_do_not_separate_the_hosts_are_refused():
    # every host reports (0, 0, 0): e.g. libtpu seeing a one-chip slice per process
    got = order_slice_hosts("s", [("a", 1, (0, 0, 0)), ("b", 0, (1, 1, 0))])
    assert not got.by_coords and got.positions == {"a": 1, "b": 0}
    assert "put hosts a, b in the same host position (0, 0, 0)" in got.warnings[0]
    # two workers of one host that disagree about their host
    got = order_slice_hosts("s", [("a", 0, (0, 0, 0)), ("a", 0, (0, 0, 1)), ("b", 1, (0, 0, 2))])
    assert not got.by_coords and "workers of host a report chips of different hosts" in got.warnings[0]


def test_duplicate_worker_ids_are_an_error_only_without_coordinates():
    t = Topology.parse("2x2x4", "TPU-V4")
    ids = [1, 1, 3, 0]
    with_coords = _infos(t, ids, lambda p, d: t.chip_coords(p, d), range(t.num_devices))
    assert layout(with_coords, t, 1).hosts == [_ip(p) for p in range(4)]
    without = _infos(t, ids, lambda p, d: None, range(t.num_devices))
    with pytest.raises(ValueError, match="TPU_WORKER_ID=1 of slice s is claimed by several hosts"):
        layout(without, t, 1)


def _worker(ip, tpu):
    return types.SimpleNamespace(metadata=types.SimpleNamespace(node_ip=ip, accelerator_ids={"TPU": [str(tpu)]}))


@settings(max_examples=30, deadline=None)
@given(_slice_with_bad_ids(), st.booleans())
def test_ray_train_worker_sort_agrees_with_layout(drawn, coords):
    """The worker sort installed into Ray Train gives the ranks `layout` gives
    (the backend fails the attempt if they differ)."""
    from ray_train_tpu import _backend

    case, t, ids, order = drawn
    if not coords:
        ids = list(range(t.num_hosts))[::-1]
    chip_of = (lambda p, d: t.chip_coords(p, d // t.devices_per_chip)) if coords else (lambda p, d: None)
    infos = _infos(t, ids, chip_of, order)
    workers = [_worker(i.node_ip, i.tpu_ids[0]) for i in infos]
    identities = [(i.slice_name, None if i.tpu_worker_id is None else str(i.tpu_worker_id), i.chip_coords)
                  for i in infos]
    ranked = compat_ray.order_tpu_workers(workers, identities, _backend._host_positions)
    by_ray = [infos[workers.index(w)] for w in ranked]
    relabelled = [WorkerInfo(**{**i.__dict__, "index": k}) for k, i in enumerate(by_ray)]
    assert layout(relabelled, t, 1).ranks == list(range(t.num_devices))


def test_one_asking_worker_per_host_orders_the_slice():
    """As `_worker_fns.host_chip_coords` reports: the worker of TPU id 0 on each
    host has the host's first chip, the others None; ids shuffled."""
    t = Topology.parse("2x2x4", "TPU-V4")
    ids = [3, 0, 2, 1]
    infos = _infos(t, ids, lambda p, d: t.chip_coords(p, 0) if d == 0 else None, range(t.num_devices)[::-1])
    out = layout(infos, t, 1)
    assert out.hosts == [_ip(p) for p in range(4)] and not out.notes
    # hosts 0, 1 and 3 carry another position's id and are named; host 2 has its own
    assert {w.split()[1] for w in out.warnings} == {_ip(0), _ip(1), _ip(3)}


def test_a_single_host_slice_never_warns_or_notes():
    """v6e 2x4: 8 chips on one host, two 2x2x1 'hosts' for torch_tpu's chip // (2, 2, 1)."""
    t = Topology.parse("2x4", "TPU-V6E")
    for chip_of in (lambda p, d: t.chip_coords(0, d), lambda p, d: None, lambda p, d: (0, 0, 0) if d == 0 else None):
        out = layout(_infos(t, [0], chip_of, range(8)), t, 1)
        assert out.ranks == list(range(8)) and not out.warnings and not out.notes


# --- torch_tpu's coordinate query: the child process (fake ones here), and where it runs ---

from ray_train_tpu import constants as C  # noqa: E402
from ray_train_tpu._compat import torch_tpu as compat_torch_tpu  # noqa: E402
from ray_train_tpu.launch_env import coords_query_env  # noqa: E402
from ray_train_tpu.testing import simulated_libtpu  # noqa: E402
from ray_train_tpu.testing.simulated_cluster import chip_layout, format_chip_layout  # noqa: E402


def _python(script):
    return [sys.executable, "-c", script]


def test_torch_tpu_coordinate_query_is_torch_tpus_child_process():
    # the child we run is the one torch_tpu's `_query_local_device_coords` runs
    argv = compat_torch_tpu.coords_argv()
    assert argv[1:] == ["-m", "torch_tpu._internal.distributed.distributed", "--print_local_device_coords"]
    import torch_tpu  # noqa: F401  (the [tpu] extra, which make test installs: never skipped)
    import importlib.util

    source = open(importlib.util.find_spec(compat_torch_tpu.COORDS_MODULE).origin).read()
    for name in (compat_torch_tpu.COORDS_FLAG, compat_torch_tpu.COORDS_PREFIX,
                 "tpu_distributed.local_device_coords()", "def _query_local_device_coords"):
        assert name in source, name


def test_coordinates_from_a_fake_child():
    got = compat_torch_tpu.query_chip_coords({}, argv=_python(
        "print('libtpu says hello'); print('TORCH_TPU_LOCAL_DEVICE_COORDS=[3, 2, 1, 0]')"))
    assert got.coords == (3, 2, 1) and got.error is None and got.seconds > 0
    # the child gets exactly the environment it is given (and this sys.path), as torch_tpu's does
    got = compat_torch_tpu.query_chip_coords({"MY_X": "5"}, argv=_python(
        "import os; print('TORCH_TPU_LOCAL_DEVICE_COORDS=[' + os.environ['MY_X'] + ', 0, ' "
        "+ str(len([k for k in os.environ if k.startswith('TPU_')])) + ']')"))
    assert got.coords == (5, 0, 0)


@pytest.mark.parametrize("script, why", [
    ("import sys; print('PJRT: no chips', file=sys.stderr); sys.exit(3)", "exited with status 3: PJRT: no chips"),
    ("import time; time.sleep(30)", "timed out after 2 s"),
    ("print('nothing useful')", "printed no"),
    ("print('TORCH_TPU_LOCAL_DEVICE_COORDS=[1, 2')", "printed no"),
    ("print('TORCH_TPU_LOCAL_DEVICE_COORDS=[\"a\", 2, 3]')", "printed no"),
])
def test_a_failing_child_is_an_answer_that_says_why_within_the_timeout(script, why):
    got = compat_torch_tpu.query_chip_coords({}, timeout_s=2, argv=_python(script))
    assert got.coords is None and why in got.error
    assert got.seconds < 10  # a timeout costs the timeout, not torch_tpu's 300 s


def test_no_tpu_no_child(monkeypatch):
    monkeypatch.setattr(compat_torch_tpu, "tpu_chip_count", lambda: 0)
    monkeypatch.setattr(compat_torch_tpu, "coords_argv", lambda: pytest.fail("no child without TPUs"))
    got = compat_torch_tpu.query_chip_coords({})
    assert got.coords is None and "no TPU chip" in got.error


# --- what libtpu answers (simulated) for the environment the query runs with ---

V4 = Topology.parse("2x2x2", "TPU-V4")


def _host(t, position):
    return {C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS: format_chip_layout(chip_layout(t, position))}


def _ray_worker_env(chip):
    """What Ray 2.60's own code sets in a {"TPU": 1} worker of a host that carries GKE's
    whole-host bounds (`TPUAcceleratorManager.set_current_process_visible_accelerator_ids`)."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    saved = {k: os.environ.get(k) for k in (C.TPU_VISIBLE_CHIPS, C.TPU_CHIPS_PER_HOST_BOUNDS, C.TPU_HOST_BOUNDS)}
    try:
        os.environ.pop(C.TPU_VISIBLE_CHIPS, None)
        os.environ.update({C.TPU_HOST_BOUNDS: "1,1,2", C.TPU_CHIPS_PER_HOST_BOUNDS: "2,2,1"})
        TPUAcceleratorManager.set_current_process_visible_accelerator_ids([str(chip)])
        return {k: os.environ[k] for k in saved if k in os.environ}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_the_old_per_worker_query_sees_a_one_chip_slice_on_every_host():
    """Each one-chip Ray worker asking for itself (the old design): libtpu sees a
    one-chip, single-host slice, every chip of every host is at (0, 0, 0), the
    hosts clash and the slice falls back to TPU_WORKER_ID order."""
    claims = []
    for position in range(V4.num_hosts):
        for chip in range(V4.chips_per_host):
            env = {**_host(V4, position), **_ray_worker_env(chip)}
            assert env[C.TPU_VISIBLE_CHIPS] == str(chip) and env[C.TPU_HOST_BOUNDS] == "1,1,1"
            claims.append((f"h{position}", position, tuple(simulated_libtpu.local_device_coords(env))))
    assert {c for _, _, c in claims} == {(0, 0, 0)}
    got = order_slice_hosts("s", claims)
    assert not got.by_coords and "in the same host position" in got.warnings[0]


@pytest.mark.parametrize("position", range(V4.num_hosts))
def test_one_query_per_host_with_the_whole_host_sees_its_place(position):
    """The design: one child per host, with the worker's env minus Ray's one-chip
    view plus the whole host's (`coords_query_env`): the host's physical place."""
    worker = {**_host(V4, position), **_ray_worker_env(3), C.RANK: "7", C.LOCAL_RANK: "3"}
    env = coords_query_env(worker, V4)
    assert C.TPU_VISIBLE_CHIPS not in env and C.RANK not in env and C.LOCAL_RANK not in env
    assert (env[C.TPU_HOST_BOUNDS], env[C.TPU_CHIPS_PER_HOST_BOUNDS]) == ("1,1,2", "2,2,1")
    assert tuple(simulated_libtpu.local_device_coords(env)) == V4.chip_coords(position, 0)


@pytest.mark.parametrize("env, refusal", [
    ({C.TPU_VISIBLE_CHIPS: "4"}, "this host has chips 0..3"),
    ({C.TPU_VISIBLE_CHIPS: "0,1", C.TPU_CHIPS_PER_HOST_BOUNDS: "1,1,1"}, "1 chip(s) per process, but 2 are visible"),
    ({C.TPU_HOST_BOUNDS: "1,1,1,x"}, "not comma-separated integers"),
    ({C.TPU_HOST_BOUNDS: "1,1,1", C.TPU_CHIPS_PER_HOST_BOUNDS: "2,2,1", C.TPU_PROCESS_BOUNDS: "2,1,1"},
     "outside the [4, 2, 1] mesh"),
])
def test_simulated_libtpu_refuses_what_libtpu_refuses(env, refusal):
    host = _host(V4, 1)  # chips at z = 1
    with pytest.raises(simulated_libtpu.LibtpuRefusal, match=re.escape(refusal)):
        simulated_libtpu.local_device_coords({**host, **env})
    with pytest.raises(simulated_libtpu.LibtpuRefusal, match="no TPU chips"):
        simulated_libtpu.local_device_coords({})


def test_simulated_libtpu_answers_through_the_same_child_path():
    env = coords_query_env({**_host(V4, 1), **_ray_worker_env(2)}, V4)
    argv = [sys.executable, "-m", "ray_train_tpu.testing.simulated_libtpu"]
    got = compat_torch_tpu.query_chip_coords(env, argv=argv)
    assert got.coords == (0, 0, 1), got.error
    got = compat_torch_tpu.query_chip_coords({**env, C.TPU_VISIBLE_CHIPS: "9"}, argv=argv)
    assert got.coords is None and "SIMULATED libtpu refuses to start" in got.error and "chips 0..3" in got.error


# --- where the query runs: one worker per host, once per Ray node ---


class _Context:
    def __init__(self, tpu_ids, node_id="n1"):
        self.tpu_ids, self.node_id = tpu_ids, node_id

    def get_accelerator_ids(self):
        return {"TPU": self.tpu_ids}

    def get_node_id(self):
        return self.node_id

    def get_node_labels(self):
        return {}


@pytest.fixture
def worker(monkeypatch, tmp_path):
    """A simulated worker process of host 1 of a v4 2x2x2 slice, asking into tmp_path."""
    import ray

    from ray_train_tpu import _worker_fns

    monkeypatch.setattr(_worker_fns, "_HOST_COORDS", {})
    monkeypatch.setattr(_worker_fns.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.2")
    for k, v in {**_host(V4, 1), C.RAY_TRAIN_TPU_SIMULATE: "1", C.TPU_TOPOLOGY: "2x2x2",
                 C.TPU_ACCELERATOR_TYPE: "v4-16", C.TPU_NAME: "s", C.TPU_WORKER_ID: "0",
                 **_ray_worker_env(0)}.items():
        monkeypatch.setenv(k, v)
    calls = []
    real = compat_torch_tpu.query_chip_coords
    monkeypatch.setattr(compat_torch_tpu, "query_chip_coords", lambda *a, **k: calls.append(a) or real(*a, **k))

    def run(tpu_ids, node_id="n1"):
        monkeypatch.setattr(ray, "get_runtime_context", lambda: _Context(tpu_ids, node_id))
        return _worker_fns.host_identity()

    run.calls, run.fns = calls, _worker_fns
    return run


def test_only_the_worker_of_tpu_id_0_asks_and_its_host_answer_is_kept(worker):
    assert worker(["2"]) == ("s", "0", None) and not worker.calls  # other chips: no child
    assert worker(["0"]) == ("s", "0", (0, 0, 1)) and len(worker.calls) == 1  # host 1's first chip
    worker.fns._HOST_COORDS.clear()  # a new worker process on the same node (next attempt)
    assert worker(["0"]) == ("s", "0", (0, 0, 1)) and len(worker.calls) == 1  # read, not asked again
    assert worker(["0"], node_id="n2")[2] == (0, 0, 1) and len(worker.calls) == 1  # this process's answer


def test_a_failed_query_is_said_once_and_not_repeated(worker, monkeypatch, caplog):
    monkeypatch.setenv(C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS, "")  # libtpu finds no chip
    assert worker(["0"])[2] is None and len(worker.calls) == 1
    assert "host 10.0.0.2: no TPU chip coordinates" in caplog.text and "Not asked again" in caplog.text
    worker.fns._HOST_COORDS.clear()
    caplog.clear()
    assert worker(["0"])[2] is None and len(worker.calls) == 1 and "no TPU chip" not in caplog.text


def test_a_single_host_slice_never_asks(worker, monkeypatch):
    monkeypatch.setenv(C.TPU_TOPOLOGY, "2x2x1")
    monkeypatch.setenv(C.TPU_ACCELERATOR_TYPE, "v4-8")
    assert worker(["0"])[2] is None and not worker.calls
    monkeypatch.delenv(C.TPU_TOPOLOGY)  # unknown slice: nothing to ask for either
    assert worker(["0"])[2] is None and not worker.calls


@pytest.mark.parametrize("coords, match", [
    ({(0, 9): (0, 0, 0)}, r"host_coords key \(0, 9\) is not"),
    ({(0, 0): (0, 0)}, r"host_coords\[\(0, 0\)\] = \(0, 0\) must be the chip coordinates"),
    ({(0, 0): (0, -1, 0)}, "three non-negative integers"),
])
def test_simulated_cluster_checks_host_coords_before_starting(coords, match):
    from ray_train_tpu.testing import simulated_tpu_cluster

    with pytest.raises(ValueError, match=match):
        with simulated_tpu_cluster("2x2x4", "TPU-V4", host_coords=coords, connect=False):
            pass


@pytest.mark.parametrize("name, accel", [("2x2x2", "TPU-V4"), ("4x4", "TPU-V6E"), ("2x4", "TPU-V6E"),
                                         ("2x2x1", "TPU-V7X"), ("4x4x4", "TPU-V5P")])
def test_a_simulated_hosts_variables_are_what_ray_reads_on_gke(monkeypatch, name, accel):
    """Ray 2.60's own TPUAcceleratorManager, on a simulated host's variables, finds the
    slice, pod type, worker id and head resource a GKE host gives it."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager as M

    from ray_train_tpu.testing.simulated_cluster import _host_env

    t = Topology.parse(name, accel)
    for worker_id in range(t.num_hosts):
        for key, value in _host_env(t, 0, worker_id).items():
            monkeypatch.setenv(key, value)
        assert M.get_current_node_tpu_pod_type() == t.pod_type
        assert M.get_current_node_tpu_topology() == t.name
        assert M.get_current_node_tpu_worker_id() == worker_id
        assert M.get_current_node_accelerator_type() == t.accelerator_type
        head = f"TPU-{t.pod_type}-head"
        assert (head in M.get_current_node_additional_resources()) == (worker_id == 0)
        layout_ = simulated_libtpu.parse_chip_layout(os.environ[C.RAY_TRAIN_TPU_SIMULATE_CHIP_COORDS])
        assert layout_ == [t.chip_coords(worker_id, i) for i in range(t.chips_per_host)]
