"""The layout planner over real model configs and every generation: the
smallest engine that holds weights + KV budget, PP only when TP cannot, as
many engines as the slice holds; refusals name the numbers; the sub-slice
shapes are the ones Ray 2.60's own sub-slice code cuts (read from Ray here).
Pure and fast: no cluster, no vLLM, no transformers."""

import io
import json
import sys

import pytest

from ray_train_tpu import cli
from ray_train_tpu.serve import layout_planner as L
from ray_train_tpu.topology import GENERATIONS, Topology, valid_topologies

# config.json as published on the Hugging Face Hub (the fields the planner reads).
QWEN25_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
              "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936,
              "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
              "num_hidden_layers": 80}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "num_local_experts": 8,
                "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Parameter counts the model cards / safetensors metadata publish (not our formula).
PUBLISHED_PARAMETERS = {"Qwen2.5-0.5B": 494_032_768, "Llama-3-8B": 8_030_261_248, "Llama-3-70B": 70_553_706_496,
                        "Mixtral-8x7B": 46_702_792_704}
CONFIGS = {"Qwen2.5-0.5B": QWEN25_05B, "Llama-3-8B": LLAMA3_8B, "Llama-3-70B": LLAMA3_70B,
           "Mixtral-8x7B": MIXTRAL_8X7B}

SLICES = {"TPU-V4": "2x2x4", "TPU-V5LITEPOD": "4x4", "TPU-V5P": "2x2x4", "TPU-V6E": "4x4", "TPU-V7X": "2x2x2"}

# (model, generation) -> (TP, PP, engine shape, engines per slice), worked out by hand
# from HBM per chip (v4 32 GiB, v5e 16, v5p 95, v6e 32, v7x 192 = 2 x 96 per core)
# x 0.9 usable, bf16 weights (0.92 / 14.96 / 131.4 GiB) and one full-context KV budget.
EXPECTED = {
    ("Qwen2.5-0.5B", g): (1, 1, "1x1x1 (1 of 2 cores)" if g == "TPU-V7X" else ("1x1" if g in ("TPU-V5LITEPOD", "TPU-V6E") else "1x1x1"), 16)
    for g in SLICES
}
EXPECTED.update({
    ("Llama-3-8B", "TPU-V4"): (1, 1, "1x1x1", 16),
    ("Llama-3-8B", "TPU-V5LITEPOD"): (2, 1, "1x2", 8),  # 14.96 GiB > 14.4 usable on one v5e chip
    ("Llama-3-8B", "TPU-V5P"): (1, 1, "1x1x1", 16),
    ("Llama-3-8B", "TPU-V6E"): (1, 1, "1x1", 16),
    ("Llama-3-8B", "TPU-V7X"): (1, 1, "1x1x1 (1 of 2 cores)", 16),
    ("Llama-3-70B", "TPU-V4"): (8, 1, "2x2x2", 2),  # a two-host sub-slice
    ("Llama-3-70B", "TPU-V5LITEPOD"): (16, 1, "4x4", 1),  # the whole slice
    ("Llama-3-70B", "TPU-V5P"): (2, 1, "1x2x1", 8),
    ("Llama-3-70B", "TPU-V6E"): (8, 1, "2x4", 2),
    ("Llama-3-70B", "TPU-V7X"): (2, 1, "1x1x1", 8),  # one chip = its two cores
})


def _footprint(name):
    return L.ModelFootprint.from_config(CONFIGS[name], source=name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameters_counted_from_config_match_the_published_counts(name):
    assert _footprint(name).num_parameters == PUBLISHED_PARAMETERS[name]


def test_kv_bytes_per_token_from_the_config():
    # Llama-3-8B: 2 (K, V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 128 KiB per token.
    fp = _footprint("Llama-3-8B")
    assert fp.kv_bytes_per_token == 128 * 2**10
    assert fp.kv_bytes_per_token_per_device(16, 1) == fp.kv_bytes_per_token // 8  # one KV head per device, replicated


@pytest.mark.parametrize("model, gen", sorted(EXPECTED))
def test_planned_layouts_over_real_models_and_every_generation(model, gen):
    plan = L.plan_layout(_footprint(model), SLICES[gen], gen)
    got = (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.engine_shape, plan.engines_per_slice)
    assert got == EXPECTED[(model, gen)], plan.describe()
    fp = plan.model
    assert fp.num_attention_heads % plan.tensor_parallel_size == 0
    assert plan.weight_bytes_per_device + plan.kv_bytes_per_device <= plan.usable_bytes_per_device
    assert plan.engines_per_slice * plan.engine_devices <= plan.topology.num_devices
    # Every smaller TP-only engine was tried and refused for a stated reason.
    smaller = [s for s in L.engine_shapes(plan.topology) if s.devices < plan.engine_devices]
    assert len(plan.rejected) == len(smaller), plan.rejected


def test_readme_example_qwen_on_a_v6e_4x4_is_sixteen_one_chip_engines_not_tp2_pp8():
    plan = L.plan_from_config(QWEN25_05B, "4x4", "v6e", source="Qwen2.5-0.5B-Instruct")
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.engines_per_slice) == (1, 1, 16)
    text = plan.describe()
    assert "TP 1 x PP 1 on 1x1" in text and "engines per slice: 16" in text and "32768 tokens" in text


def test_pipeline_parallelism_only_when_no_tp_only_engine_fits():
    # 40 heads (e.g. Qwen2.5-14B/32B), too big for 8 v5e chips: TP 16 does not divide 40 -> TP 8 x PP 2.
    big = L.ModelFootprint(num_parameters=100_000_000_000, dtype="bfloat16", num_attention_heads=40,
                           num_key_value_heads=8, num_hidden_layers=64, head_dim=128, max_context=4096, source="big")
    plan = L.plan_layout(big, "4x4", "v5e")
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.engine_shape) == (8, 2, "4x4")
    assert any("TP 16 x PP 1" in r and "40 attention heads" in r for r in plan.rejected)
    # With room for TP 8 alone (v6e: 2 x 16 GiB per device) no pipeline is planned.
    assert L.plan_layout(big, "4x4", "v6e").pipeline_parallel_size == 1


def test_every_choice_can_be_given():
    fp = _footprint("Llama-3-8B")
    plan = L.plan_layout(fp, "4x4", "v6e", tensor_parallel_size=4, engines_per_slice=2, kv_cache_tokens=100_000)
    assert (plan.tensor_parallel_size, plan.engine_shape, plan.engines_per_slice, plan.kv_cache_tokens) == \
        (4, "2x2", 2, 100_000)
    assert L.plan_layout(fp, "4x4", "v6e", tensor_parallel_size=8, pipeline_parallel_size=2).whole_slice
    # A KV budget the one-chip engine cannot hold moves the plan to TP 2.
    assert L.plan_layout(fp, "4x4", "v6e", kv_cache_tokens=150_000).tensor_parallel_size == 2
    tight = L.plan_layout(fp, "4x4", "v6e", memory_utilization=0.45)
    assert tight.tensor_parallel_size == 2 and tight.memory_utilization == 0.45
    # engine_kwargs as vLLM names them
    fp32 = L.plan_from_config(LLAMA3_8B, "4x4", "v6e", engine_kwargs={"dtype": "float32", "max_model_len": 1024})
    assert (fp32.model.dtype, fp32.kv_cache_tokens, fp32.tensor_parallel_size) == ("float32", 1024, 2)


@pytest.mark.parametrize(
    "model, topology, gen, kwargs, words",
    [
        ("Qwen2.5-0.5B", "4x4", "v6e", {"tensor_parallel_size": 4},
         ["tensor_parallel_size 4", "14 attention heads do not divide by 4", "leave tensor_parallel_size"]),
        ("Llama-3-8B", "4x4", "v6e", {"tensor_parallel_size": 3, "pipeline_parallel_size": 1},
         ["3 devices is no engine shape of one TPU-V6E 4x4", "valid engine sizes: 1 (1x1), 2 (1x2), 4 (2x2), 8 (2x4)"]),
        ("Llama-3-8B", "4x4", "v6e", {"tensor_parallel_size": 6, "pipeline_parallel_size": 2},
         ["12 devices is no engine shape"]),
        ("Llama-3-70B", "2x2", "v5e", {},
         ["131.4 GiB in bfloat16", "has no layout on one TPU-V5LITEPOD 2x2", "14.4 GiB usable",
          "> 14.40 GiB usable", "use a larger slice"]),
        ("Llama-3-8B", "4x4", "v6e", {"engines_per_slice": 17}, ["engines_per_slice 17", "at most 16"]),
        ("Llama-3-8B", "4x4", "v6e", {"kv_cache_tokens": 0}, ["kv_cache_tokens 0 must be an integer >= 1"]),
        ("Llama-3-8B", "4x5", "v6e", {}, ["topology '4x5' is not a TPU-V6E slice"]),
    ],
    ids=["tp-not-dividing-heads", "shape-not-cut", "pp-shape-not-cut", "does-not-fit", "too-many-engines",
         "bad-kv", "bad-slice"],
)
def test_a_layout_that_cannot_run_is_refused_naming_the_numbers(model, topology, gen, kwargs, words):
    with pytest.raises(ValueError) as e:
        L.plan_layout(_footprint(model), topology, gen, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_config_it_cannot_count_asks_for_num_parameters():
    with pytest.raises(ValueError, match="give num_parameters"):
        L.ModelFootprint.from_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2})
    fp = L.ModelFootprint.from_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2},
                                      num_parameters=10**6, dtype="float16")
    assert fp.weight_bytes == 2 * 10**6
    with pytest.raises(ValueError, match="dtype 'int3' is not a dtype"):
        L.ModelFootprint.from_config(QWEN25_05B, dtype="int3")


def _ray_subslices(parent: str, version: str) -> dict:
    """Sub-slice shapes -> how many Ray 2.60 cuts from `parent`: the labels its
    sub-slice discovery gives every worker of the parent (``_build_subslice_labels``),
    counting an index only when it has all the hosts the shape needs (as
    ``_find_available_subslice`` requires), for shapes ``subslice_placement_group``
    accepts for `version`."""
    import math
    from collections import Counter

    from ray._private.accelerators import tpu as ray_tpu

    hosts: dict = {}
    for w in range(math.prod(ray_tpu._get_worker_dims_for_topology(parent))):
        for key, idx in ray_tpu._build_subslice_labels(w, parent).items():
            hosts.setdefault(key[len(ray_tpu.TPU_SUBSLICE_LABEL_PREFIX):], Counter())[idx] += 1
    return {shape: sum(n == math.prod(ray_tpu._get_worker_dims_for_topology(shape)) for n in per_index.values())
            for shape, per_index in hosts.items()
            if ray_tpu.TPUAcceleratorManager.is_valid_tpu_accelerator_topology(version, shape)}


def test_sub_slice_shapes_are_the_ones_rays_subslice_placement_group_cuts():
    from ray._private.accelerators import tpu as ray_tpu

    table = [*ray_tpu._VALID_TOPOLOGY_WORKER_DIMS_2D, *ray_tpu._VALID_TOPOLOGY_WORKER_DIMS_3D]
    assert set(L.RAY_SUBSLICE_SHAPES) == {g.pod_prefix for g in GENERATIONS.values()}
    for version, shapes in L.RAY_SUBSLICE_SHAPES.items():
        accepted = ray_tpu.TPUAcceleratorManager.is_valid_tpu_accelerator_topology
        assert shapes == {t for t in table if accepted(version, t)}, version

    checked = 0
    for gen in GENERATIONS.values():
        for name in valid_topologies(gen.accelerator_type):
            topo = Topology.parse(name, gen.accelerator_type)
            if not topo.is_multi_host:
                continue
            if name not in L.RAY_SUBSLICE_SHAPES[gen.pod_prefix]:  # Ray cuts no sub-slices from it
                assert not [s for s in L.engine_shapes(topo) if s.cut_by == "SubslicePlacementGroup"]
                continue
            ours = {s.name: s.count for s in L.engine_shapes(topo) if s.cut_by == "SubslicePlacementGroup"}
            ray_cuts = _ray_subslices(name, gen.pod_prefix)
            assert {k: ray_cuts.get(k) for k in ours} == ours, (gen.accelerator_type, name)
            # What we leave out is a shape that does not tile the slice (Ray numbers
            # those sub-slices inconsistently: 8x8x16 in 16x16x24 gets 1, not 4).
            parent = ray_tpu._get_worker_dims_for_topology(name)
            for shape in set(ray_cuts) - set(ours):
                sub = ray_tpu._get_worker_dims_for_topology(shape)
                assert any(p % s for p, s in zip(parent, sub)), (gen.accelerator_type, name, shape)
            checked += 1
    assert checked > 20


def test_sub_host_engines_are_what_ray_lets_one_process_hold():
    from ray._private.accelerators import tpu as ray_tpu

    assert set(L.SUB_HOST_DEVICES) == set(ray_tpu.TPU_VALID_CHIP_OPTIONS)
    # The chip bounds Ray gives a one- and a two-chip process.
    for chips, bounds in ((1, ray_tpu.TPU_CHIPS_PER_HOST_BOUNDS_1_CHIP_CONFIG),
                          (2, ray_tpu.TPU_CHIPS_PER_HOST_BOUNDS_2_CHIP_CONFIG)):
        assert ",".join(map(str, L._SUB_HOST_CHIP_BOUNDS[chips])) == bounds
    for gen in GENERATIONS.values():
        for name in valid_topologies(gen.accelerator_type):
            topo = Topology.parse(name, gen.accelerator_type)
            for shape in L.engine_shapes(topo):
                if shape.cut_by == "part of one host":
                    assert ray_tpu.TPUAcceleratorManager.validate_resource_request_quantity(shape.devices)[0]
                    assert shape.devices * shape.count == topo.num_devices


def test_serve_plan_prints_the_layout_and_starts_nothing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    before = {m for m in ("ray", "vllm", "transformers") if m in sys.modules}
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["serve", "--model", str(tmp_path), "--topology", "4x4", "--accelerator-type", "TPU-V6E",
                     "--plan"], out=out, err=err)
    text = out.getvalue()
    assert code == 0 and err.getvalue() == "", err.getvalue()
    assert "engine: TP 1 x PP 1 on 1x1" in text and "engines per slice: 16" in text
    assert "serve runs this layout with --engine-shape 1x1 --num-replicas 16" in text
    assert {m for m in ("ray", "vllm", "transformers") if m in sys.modules} == before
    # Overrides reach the planner; a refused one is one line, exit 2.
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["serve", "--model", str(tmp_path), "--topology", "4x4", "--accelerator-type", "TPU-V6E",
                     "--plan", "--tensor-parallel-size", "4"], out=out, err=err)
    assert code == 2 and err.getvalue().count("\n") == 1 and "14 attention heads" in err.getvalue()
    code = cli.main(["serve", "--model", str(tmp_path), "--topology", "4x4", "--accelerator-type", "TPU-V6E",
                     "--kv-cache-tokens", "10"], out=out, err=err)
    assert code == 2 and "give it with --plan" in err.getvalue()


def test_the_readme_shows_what_the_planner_prints_now(tmp_path, monkeypatch):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = "$ python -m ray_train_tpu serve --model Qwen/Qwen2.5-0.5B-Instruct --topology 4x4"
    block = readme[readme.index(command):].split("\n\n")[0].splitlines()
    shown = [line.strip() for line in block[1:]]
    model = tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN25_05B))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    argv = block[0].strip()[len("$ python -m ray_train_tpu "):].split()
    assert cli.main(argv, out=out, err=io.StringIO()) == 0
    assert out.getvalue().splitlines() == shown


def test_the_batch_docs_show_what_the_planner_prints_now(tmp_path, monkeypatch):
    """docs/batch.md's --plan block: its lines, in order, among what batch --plan prints ("..." skips)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "batch.md").read_text()
    command = "$ python -m ray_train_tpu batch --model Qwen/Qwen2.5-0.5B-Instruct --topology 4x4"
    block = doc[doc.index(command):].split("\n\n")[0].splitlines()
    shown = [line.strip() for line in block[1:] if line.strip() != "..."]
    model = tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(QWEN25_05B))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    assert cli.main(block[0].strip()[len("$ python -m ray_train_tpu "):].split(), out=out, err=io.StringIO()) == 0
    printed = out.getvalue().splitlines()
    assert [line for line in printed if line in shown] == shown, printed


def test_batch_plan_prints_the_layout_without_input_or_output(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["batch", "--model", str(tmp_path), "--topology", "4x4", "--accelerator-type", "v5e", "--plan"],
                    out=out, err=err)
    assert code == 0 and "engine: TP 2 x PP 1 on 1x2" in out.getvalue(), err.getvalue()
    assert "batch runs this layout with --engine-shape 1x2 --engines-per-slice 8" in out.getvalue()
    code = cli.main(["batch", "--model", str(tmp_path), "--topology", "4x4", "--accelerator-type", "v5e"],
                    out=out, err=err)
    assert code == 2 and "required: --input, --output (unless --plan)" in err.getvalue()
