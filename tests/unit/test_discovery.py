"""layout: ranks from what workers report, independent of Ray's worker order."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_train_tpu.launch_env import launch_envs
from ray_train_tpu.discovery import LayoutError, WorkerInfo, layout
from ray_train_tpu.topology import Topology


def _infos(t, num_slices=1, order=None, overrides=None):
    overrides = overrides or {}
    infos = []
    for s in range(num_slices):
        for w in range(t.num_hosts):
            for d in range(t.devices_per_host):
                infos.append(dict(node_ip=f"127.0.{s}.{w + 2}", slice_name=f"slice-{s}", tpu_worker_id=w,
                                  tpu_ids=(d,), node_tpus=t.devices_per_host))
    if order is not None:
        infos = [infos[i] for i in order]
    return [WorkerInfo(index=i, **(info | overrides.get(i, {}))) for i, info in enumerate(infos)]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([("2x2x2", "TPU-V4"), ("4x4", "TPU-V6E"), ("2x2x2", "TPU-V7X")]), st.integers(1, 2), st.randoms())
def test_ranks_follow_slice_worker_id_and_chip_whatever_the_order(case, num_slices, rnd):
    t = Topology.parse(*case)
    n = t.num_devices * num_slices
    order = list(range(n))
    rnd.shuffle(order)
    infos = _infos(t, num_slices, order)
    out = layout(infos, t, num_slices)
    assert sorted(out.ranks) == list(range(n))
    envs = dict((p.rank, (p, e)) for p, e in launch_envs(t, out.hosts, num_slices=num_slices, xprof_session_id="1"))
    for info, rank in zip(infos, out.ranks):
        place, env = envs[rank]
        assert env["TPU_WORKER_ID"] == str(info.tpu_worker_id)
        assert place.local_rank == info.tpu_ids[0]
        assert out.hosts[place.node_rank] == info.node_ip
        assert place.slice_id == int(info.slice_name.split("-")[1])
    assert [out.ranks[i] for i in out.index_of_rank()] == list(range(n))


def test_two_chips_per_worker_is_refused():
    t = Topology.parse("2x2x2", "TPU-V4")
    infos = _infos(t, overrides={3: dict(tpu_ids=(3, 4))})
    with pytest.raises(LayoutError, match=r"exactly one TPU device per worker.*worker 3 on host 127.0.0.2.*holds 2"):
        layout(infos, t, 1)


def test_hosts_with_different_chip_counts_are_refused():
    t = Topology.parse("2x2x2", "TPU-V4")
    infos = _infos(t, overrides={i: dict(node_tpus=8) for i in range(4, 8)})
    with pytest.raises(LayoutError, match=r"host 127.0.0.3 .* reports \[8\] TPU resources but .* has 4"):
        layout(infos, t, 1)


def test_missing_worker_id_and_duplicate_ids_are_named():
    t = Topology.parse("2x2x2", "TPU-V4")
    with pytest.raises(LayoutError, match="needs TPU_NAME and TPU_WORKER_ID .* or Ray.s ray.io/tpu-slice-name and ray.io/tpu-worker-id node labels"):
        layout(_infos(t, overrides={0: dict(tpu_worker_id=None)}), t, 1)
    dup = {i: dict(tpu_worker_id=0) for i in range(4, 8)}
    with pytest.raises(LayoutError, match="TPU_WORKER_ID=0 of slice slice-0 is claimed by several hosts"):
        layout(_infos(t, overrides=dup), t, 1)


def test_wrong_worker_count_and_partial_slices():
    t = Topology.parse("2x2x2", "TPU-V4")
    with pytest.raises(LayoutError, match="7 workers cannot fill"):
        layout(_infos(t)[:7], t, 1)
    # 16 workers on two 2x2x2 slices are not one 2x2x4 slice
    with pytest.raises(LayoutError, match="span 2 TPU slice"):
        layout(_infos(t, 2), Topology.parse("2x2x4", "TPU-V4"), 1)
    # a slice missing host 1 while another slice has an extra host
    infos = _infos(t, 2, overrides={i: dict(slice_name="slice-0", tpu_worker_id=2, node_ip="127.0.9.9") for i in range(12, 16)})
    with pytest.raises(LayoutError, match=r"slice slice-0 is not whole.*unexpected \[2\]"):
        layout(infos, t, 2)


def test_worker_report_is_typed_and_keeps_the_dict_that_serve_reads():
    from ray_train_tpu.discovery import Mode, WorkerReport, job_mode

    r = WorkerReport(node_ip="10.0.0.2", node_id="n1", slice_name="s", tpu_worker_id=1, accelerator_type="v4-16",
                     topology="2x2x2", tpu_ids=(3,), mode=Mode.SIMULATE, preset={"MASTER_PORT": "1"})
    assert r.info(index=5, node_tpus=4) == WorkerInfo(index=5, node_ip="10.0.0.2", slice_name="s", tpu_worker_id=1,
                                                      tpu_ids=(3,), node_tpus=4)
    d = r.as_dict()
    assert d["worker_id"] == "1" and d["simulate"] is True and d["tpu_ids"] == [3] and "tpu_worker_id" not in d
    assert {"node_ip", "slice_name", "node_id", "preset"} <= set(d)
    assert job_mode([r, r]) is Mode.SIMULATE and Mode.SIMULATE == "simulate" and str(Mode.TPU) == "tpu"
    with pytest.raises(ValueError, match="RAY_TRAIN_TPU_SIMULATE=1 is set on some workers but not others"):
        job_mode([r, WorkerReport(**{**r.__dict__, "mode": Mode.TPU})])
