"""The LLMConfig for a slice, as Ray Serve LLM reads it (imports ray.serve.llm,
~20 s; starts no Ray cluster), and the engine's pure helpers."""

import logging
import os

import pytest

from ray_train_tpu.launch_env import launch_env
from ray_train_tpu.serve import SliceServeSpec, smollm2_gguf
from ray_train_tpu.topology import Topology


@pytest.fixture(scope="module", autouse=True)
def _restore_process_state():
    """Importing ray.serve.llm imports vLLM, which sets environment variables and
    a root log handler; give the rest of the suite back the process it had."""
    env, root = dict(os.environ), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    os.environ.clear()
    os.environ.update(env)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="module")
def config():
    from ray_train_tpu.serve import build_llm_config

    return build_llm_config(smollm2_gguf(), "4x4", "TPU-V6E", model_id="smollm2", num_replicas=2)


def test_llm_config_asks_ray_for_one_whole_slice_per_replica(config):
    from ray_train_tpu.serve import TorchTPULLMServer

    assert config.server_cls is TorchTPULLMServer
    assert config.accelerator_type == "TPU-V6E"
    assert (config.accelerator_config.kind, config.accelerator_config.topology) == ("tpu", "4x4")
    assert config.deployment_config["num_replicas"] == 2
    assert config.runtime_env["env_vars"]["VLLM_TARGET_DEVICE"] == "cpu"
    assert config.runtime_env["env_vars"]["TPU_SKIP_MDS_QUERY"] == "1"
    engine_config = config.get_engine_config()  # Ray's own view of the replica
    assert engine_config.accelerator.requires_deferred_placement_group
    assert engine_config.placement_bundles == SliceServeSpec(accelerator_type="v6e", topology="4x4").bundles()


def test_engine_validates_the_config_before_starting(config):
    from ray_train_tpu.serve import TorchTPUEngine, build_llm_config

    engine = TorchTPUEngine(config)
    assert engine.spec.tensor_parallel_size == 16 and engine.model_source == smollm2_gguf()
    bad = build_llm_config(smollm2_gguf(), "4x4", "TPU-V6E")
    bad.engine_kwargs["tensor_parallel_size"] = 4
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not fit"):
        TorchTPUEngine(bad)
    bad.accelerator_config.topology = None
    with pytest.raises(ValueError, match="has no TPU topology"):
        TorchTPUEngine(bad)


def test_build_llm_config_refuses_bad_input_before_ray_serve_llm():
    from ray_train_tpu.serve import build_llm_config

    with pytest.raises(ValueError, match="topology '4x3'"):
        build_llm_config(smollm2_gguf(), "4x3", "TPU-V6E")
    with pytest.raises(ValueError, match="num_replicas 0"):
        build_llm_config(smollm2_gguf(), "4x4", "TPU-V6E", num_replicas=0)


def _report(worker_id, ip, slice_name="s0"):
    return {"worker_id": str(worker_id), "node_ip": ip, "slice_name": slice_name}


def test_host_workers_are_ordered_by_tpu_worker_id_and_get_launch_env():
    from ray_train_tpu.serve.engine import host_envs, host_order

    spec = SliceServeSpec(accelerator_type="TPU-V6E", topology="4x4")
    reports = [_report(2, "h2"), _report(0, "h0"), _report(3, "h3"), _report(1, "h1")]
    order = host_order(reports, spec)
    assert [reports[i]["node_ip"] for i in order] == ["h0", "h1", "h2", "h3"]
    envs = host_envs(spec, ["h0", "h1", "h2", "h3"], "7")
    topo = Topology.parse("4x4", "TPU-V6E")
    for w, env in enumerate(envs):
        expected = launch_env(topo, ["h0", "h1", "h2", "h3"], rank=4 * w, xprof_session_id="7")
        assert "TPU_VISIBLE_CHIPS" not in env  # Ray's, for the 4 chips the worker holds
        assert env == {k: v for k, v in expected.items() if k != "TPU_VISIBLE_CHIPS"}
        assert env["TPU_WORKER_ID"] == str(w) and env["MASTER_ADDR"] == "h0"


@pytest.mark.parametrize(
    "reports",
    [
        [_report(0, "a"), _report(1, "b"), _report(2, "c")],  # a host short
        [_report(0, "a"), _report(1, "b"), _report(1, "c"), _report(3, "d")],  # a worker id twice
        [_report(0, "a"), _report(1, "b"), _report(2, "c"), _report(3, "d", "s1")],  # two slices
    ],
)
def test_host_workers_that_are_not_one_slice_are_refused(reports):
    from ray_train_tpu.serve.engine import host_order

    with pytest.raises(RuntimeError, match="are not the 4 hosts of one"):
        host_order(reports, SliceServeSpec(accelerator_type="TPU-V6E", topology="4x4"))


def test_serve_cli_prints_the_llm_config_as_json():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ray_train_tpu", "serve", "--model", "smollm2", "--topology", "4x4",
         "--accelerator-type", "v6e", "--num-replicas", "2", "--print-config"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TPU_SKIP_MDS_QUERY": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config = json.loads(out.stdout)  # stdout is only the JSON (vLLM logs go to stderr)
    assert config["accelerator_type"] == "TPU-V6E"
    assert config["accelerator_config"] == {"kind": "tpu", "topology": "4x4"}
    assert config["engine_kwargs"] == {"tensor_parallel_size": 16}
    assert config["deployment_config"] == {"num_replicas": 2}
    assert config["model_loading_config"]["model_id"] == "smollm2"
    assert config["server_cls"] == "ray_train_tpu.serve.engine.TorchTPULLMServer"
