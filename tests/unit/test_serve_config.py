"""The LLMConfig for a slice as Ray Serve LLM reads it (imports ray.serve.llm and
so vLLM, ~20 s; starts no Ray cluster); which vLLM platform runs where; and the
real-TPU (vllm-torchtpu) config path, checked without that package."""

import json
import logging
import os
import subprocess
import sys

import pytest

from ray_train_tpu.launch_env import launch_env
from ray_train_tpu.serve import platforms as P
from ray_train_tpu.serve.slice_plan import BundlePlace, plan_slice
from ray_train_tpu.topology import Topology

TINY = {"num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 2,
        "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.fixture(scope="module", autouse=True)
def _simulated_process():
    """libtpu is installed here, so vLLM needs RAY_TRAIN_TPU_SIMULATE=1 to import
    (see test_a_tpu_host_without_vllm_torchtpu_gets_a_clear_error). Importing
    vLLM also sets variables and a root log handler: give them back."""
    env, root = dict(os.environ), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    os.environ["RAY_TRAIN_TPU_SIMULATE"] = "1"
    yield
    os.environ.clear()
    os.environ.update(env)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


def test_llm_config_is_the_stock_vllm_engine_on_one_whole_slice_per_replica(model_dir):
    from ray.serve.llm import LLMServer

    from ray_train_tpu.serve import build_llm_config

    config = build_llm_config(model_dir, "2x2x2", "v4", model_id="tiny", num_replicas=2, simulate=True)
    assert config.server_cls is None or config.server_cls is LLMServer  # Ray's own server and engine
    assert config.accelerator_type == "TPU-V4"
    assert (config.accelerator_config.kind, config.accelerator_config.topology) == ("tpu", "2x2x2")
    assert config.placement_group_config == {"bundle_per_worker": {"TPU": 1}}
    kw = config.engine_kwargs
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"], kw["distributed_executor_backend"]) == (8, 1, "ray")
    assert config.deployment_config["num_replicas"] == 2
    env = config.runtime_env["env_vars"]
    assert env["RAY_TRAIN_TPU_SIMULATE"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["TPU_SKIP_MDS_QUERY"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_TARGET_DEVICE" not in env  # it would disable every platform plugin
    assert config.callback_config.callback_class == "ray_train_tpu.serve._callback.SliceLayoutCallback"
    engine = config.get_engine_config()  # Ray's own view of a replica
    assert engine.accelerator.requires_deferred_placement_group  # a slice, reserved when it starts
    assert [b["TPU"] for b in engine.placement_bundles] == [1] * 8


def test_real_tpu_config_path_asks_vllm_torchtpu_for_its_ray_executor(model_dir):
    from ray_train_tpu.serve import build_llm_config

    config = build_llm_config(model_dir, "4x4", "TPU-V6E", simulate=False, pipeline_parallel_size=2)
    env = config.runtime_env["env_vars"]
    # vllm_torchtpu/platforms/tpu_platform.py: TPU_MULTIHOST_BACKEND=ray and the V2
    # flag select vllm_torchtpu/executors/ray_distributed_executor_v2.py.
    assert env["TPU_MULTIHOST_BACKEND"] == "ray" and env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] == "1"
    assert "RAY_TRAIN_TPU_SIMULATE" not in env and "GLOO_SOCKET_IFNAME" not in env
    assert (config.engine_kwargs["tensor_parallel_size"], config.engine_kwargs["pipeline_parallel_size"]) == (8, 2)
    assert "kv_cache_memory_bytes" not in config.engine_kwargs


def test_build_llm_config_refuses_bad_input_before_ray_serve_llm(model_dir):
    from ray_train_tpu.serve import build_llm_config

    with pytest.raises(ValueError, match="topology '4x3'"):
        build_llm_config(model_dir, "4x3", "TPU-V6E")
    with pytest.raises(ValueError, match="num_replicas 0"):
        build_llm_config(model_dir, "4x4", "TPU-V6E", num_replicas=0)
    with pytest.raises(ValueError, match="9 attention heads do not divide by 2"):
        d = os.path.join(model_dir, "nine")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**TINY, "num_attention_heads": 9, "num_key_value_heads": 3}, f)
        build_llm_config(d, "2x2x2", "TPU-V4", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="distributed_executor_backend 'mp'"):
        build_llm_config(model_dir, "2x2x2", "TPU-V4", engine_kwargs={"distributed_executor_backend": "mp"})


@pytest.mark.parametrize(
    "env, torchtpu, evidence, expected",
    [
        ({"RAY_TRAIN_TPU_SIMULATE": "1"}, False, ["libtpu is installed"], P.SIMULATED_PLATFORM),
        ({}, True, ["libtpu is installed"], None),  # vllm-torchtpu's own plugin
        ({}, False, ["libtpu is installed"], P.MISSING_PLATFORM),
        ({"RAY_TRAIN_TPU_SIMULATE": "0"}, False, ["TPU_WORKER_ID=0"], P.MISSING_PLATFORM),
        ({}, False, [], None),  # a CPU-only head or laptop: vLLM decides
    ],
)
def test_platform_choice(env, torchtpu, evidence, expected):
    assert P.select_platform(env, torchtpu_installed=torchtpu, tpu_evidence=evidence) == expected


def test_tpu_host_evidence():
    assert P.tpu_host_evidence({}, False, []) == []
    assert P.tpu_host_evidence({"TPU_ACCELERATOR_TYPE": "v6e-16"}, True, ["/dev/accel0"]) == [
        "libtpu is installed", "TPU devices /dev/accel0", "TPU_ACCELERATOR_TYPE=v6e-16"]


def test_a_tpu_host_without_vllm_torchtpu_gets_a_clear_error():
    """libtpu is installed here (torch-tpu): without simulation vLLM must refuse,
    naming what to install, rather than run on its CPU platform."""
    import importlib.util

    assert importlib.util.find_spec("libtpu"), "needs libtpu, from the tpu extra (torch-tpu), as make installs"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_TRAIN_TPU_SIMULATE", "VLLM_TARGET_DEVICE")}
    code = "from vllm.platforms import current_platform; print(current_platform.device_type)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    assert "vllm-torchtpu" in out.stderr and "RAY_TRAIN_TPU_SIMULATE=1" in out.stderr, out.stderr[-2000:]
    sim = subprocess.run([sys.executable, "-c", code + "; print(current_platform.ray_device_key)"],
                         capture_output=True, text=True, timeout=300, env={**env, "RAY_TRAIN_TPU_SIMULATE": "1"})
    assert sim.stdout.split()[-2:] == ["cpu", "TPU"], sim.stderr[-2000:]


def _plan():
    topo = Topology.parse("2x2x2", "TPU-V4")
    places = [BundlePlace(index=i, node_id=f"n{i % 2}", node_ip=f"10.0.0.{9 - i % 2}", slice_name="s",
                          worker_id=i % 2, chip=i // 2) for i in range(8)]
    return topo, plan_slice(topo, places, xprof_session_id="3")


def test_vllm_torchtpu_executor_is_confined_to_the_replicas_slice(monkeypatch):
    """vllm_torchtpu/executors/ray_distributed_executor_v2.py builds the slice from
    every TPU node in ray.nodes(); our general plugin makes it read the plan."""
    topo, plan = _plan()

    class FakeExecutor:  # the method we replace, as vllm-torchtpu 0.29.0 spells it
        def _slice_host_layout(self, device_str):
            return ["every", "tpu", "node"], {}

    P.confine_torchtpu_executor(FakeExecutor)
    P.confine_torchtpu_executor(FakeExecutor)  # idempotent
    monkeypatch.delenv(P.SLICE_PLAN_ENV, raising=False)
    assert FakeExecutor()._slice_host_layout("TPU") == (["every", "tpu", "node"], {})
    monkeypatch.setenv(P.SLICE_PLAN_ENV, plan.to_json())
    hosts, chips_per_host = FakeExecutor()._slice_host_layout("TPU")
    assert hosts == ["10.0.0.9", "10.0.0.8"] and chips_per_host == {"10.0.0.9": 4, "10.0.0.8": 4}
    # vllm-torchtpu's own address formula (same file, step 7) over that layout is
    # launch_env's TORCH_TPU_SLICEBUILDER_ADDRESSES: one convention, two code paths.
    theirs = ",".join(f"{ip}:{8070 + chip}" for ip in hosts for chip in range(chips_per_host[ip]))
    ours = launch_env(topo, hosts, rank=0, xprof_session_id="3")
    assert theirs == ours["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
    assert {i: ip for i, ip in enumerate(hosts)}[0] == ours["MASTER_ADDR"]  # their master: host_order[0]


def test_general_plugin_does_nothing_without_vllm_torchtpu(monkeypatch):
    monkeypatch.delenv("RAY_TRAIN_TPU_SIMULATE", raising=False)
    P.vllm_general_plugin()  # vllm-torchtpu is not installed here (Python 3.11): no import attempted


def test_serve_cli_prints_the_llm_config_as_json(model_dir):
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1"}
    env.pop("RAY_TRAIN_TPU_SIMULATE", None)
    out = subprocess.run(
        [sys.executable, "-m", "ray_train_tpu", "serve", "--model", model_dir, "--model-id", "tiny",
         "--topology", "2x2x2", "--accelerator-type", "v4", "--num-replicas", "2", "--simulate", "--print-config",
         "--engine-kwargs", '{"max_model_len": 256}'],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    config = json.loads(out.stdout)  # stdout is only the JSON (vLLM logs go to stderr)
    assert config["accelerator_type"] == "TPU-V4"
    assert config["accelerator_config"] == {"kind": "tpu", "topology": "2x2x2"}
    assert config["engine_kwargs"]["tensor_parallel_size"] == 8
    assert config["engine_kwargs"]["max_model_len"] == 256
    assert config["deployment_config"] == {"num_replicas": 2}
    assert config["model_loading_config"]["model_id"] == "tiny"
    assert config["callback_config"]["callback_kwargs"] == {"topology": "2x2x2", "accelerator_type": "TPU-V4"}
