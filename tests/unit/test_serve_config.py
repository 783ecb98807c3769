"""The LLMConfig for a slice as Ray Serve LLM reads it (imports ray.serve.llm and
so vLLM, ~20 s; starts no Ray cluster); which vLLM platform runs where; and the
real-TPU (vllm-torchtpu) config path, checked without that package."""

import inspect
import json
import logging
import os
import subprocess
import sys

import pytest

from ray_train_tpu.serve import platforms as P

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
    assert config.placement_group_config == {"bundle_per_worker": {"TPU": 1}, "strategy": "SPREAD"}
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
    # vllm-torchtpu takes TORCH_TPU_TOPOLOGY before its own table by world size.
    assert env["TORCH_TPU_TOPOLOGY"] == "4,4,1"
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


def test_general_plugin_starts_vllm_workers_in_our_worker_proc(monkeypatch):
    """vLLM loads the plugin in every process; its Ray executors (V2) then start
    every worker in SliceWorkerProc. vllm-torchtpu is not installed here
    (Python 3.11): no import of it is attempted."""
    import vllm.v1.executor.ray_executor_v2 as v2

    from ray_train_tpu._compat import vllm as V
    from ray_train_tpu.serve._worker_proc import SliceWorkerProc

    monkeypatch.setattr(v2, "RayWorkerProc", V.original_worker_proc())
    monkeypatch.delenv("RAY_TRAIN_TPU_SIMULATE", raising=False)
    P.vllm_general_plugin()
    assert v2.RayWorkerProc is SliceWorkerProc
    P.vllm_general_plugin()  # idempotent
    assert v2.RayWorkerProc is SliceWorkerProc and issubclass(SliceWorkerProc, V.original_worker_proc())
    assert "vllm_torchtpu" not in sys.modules


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
    assert config["placement_group_config"]["strategy"] == "SPREAD"  # two hosts, pinned to one slice
    assert config["model_loading_config"]["model_id"] == "tiny"
    assert config["callback_config"]["callback_kwargs"] == {"topology": "2x2x2", "accelerator_type": "TPU-V4"}


def test_autoscaling_counts_slices_and_never_beside_num_replicas(model_dir, monkeypatch):
    import types

    import ray

    from ray_train_tpu.serve import build_llm_config

    # Ray Serve LLM's get_deployment_options reads the driver's runtime env through
    # ray.get_runtime_context(), which would connect this process to Ray (or to any
    # cluster running on the machine): a driver without a runtime env instead.
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(runtime_env={}))

    config = build_llm_config(model_dir, "2x2x2", "v4", simulate=True,
                              autoscaling_config={"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 5})
    deployment = config.deployment_config  # Ray's LLMConfig validated it as a Serve DeploymentConfig
    assert "num_replicas" not in deployment
    assert deployment["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 5,
                                                "target_ongoing_requests": 16}
    # Ray Serve LLM's builder keeps it (its own default target, 1e9, would never scale).
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment

    options = build_llm_deployment(config)._bound_deployment._deployment_config
    assert (options.autoscaling_config.min_replicas, options.autoscaling_config.max_replicas) == (1, 3)
    assert options.autoscaling_config.target_ongoing_requests == 16
    same = build_llm_config(model_dir, "2x2x2", "v4", simulate=True,
                            deployment_config={"autoscaling_config": {"max_replicas": 2}})
    assert same.deployment_config["autoscaling_config"]["max_replicas"] == 2
    for kwargs, words in [
        ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}, "num_replicas 2 and autoscaling_config"),
        ({"deployment_config": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}}, "both given"),
        ({"autoscaling_config": {"min_replicas": 2, "max_replicas": 1}}, "max_replicas 1 must be >= min_replicas 2"),
        ({"autoscaling_config": {"min_replicas": 1}}, "max_replicas None must be an integer"),
        ({"autoscaling_config": {"min_replicas": -1, "max_replicas": 1}}, "min_replicas -1"),
    ]:
        with pytest.raises(ValueError, match=words):
            build_llm_config(model_dir, "2x2x2", "v4", simulate=True, **kwargs)


def test_engine_metrics_and_lora_pass_through(model_dir):
    from ray_train_tpu.serve import build_llm_config

    plain = build_llm_config(model_dir, "2x2x2", "v4", simulate=True)
    assert plain.log_engine_metrics is False and plain.lora_config is None
    config = build_llm_config(model_dir, "2x2x2", "v4", simulate=True, log_engine_metrics=True,
                              lora_config={"dynamic_lora_loading_path": "gs://bucket/adapters",
                                           "max_num_adapters_per_replica": 2})
    assert config.log_engine_metrics is True
    assert config.lora_config.dynamic_lora_loading_path == "gs://bucket/adapters"
    assert config.lora_config.max_num_adapters_per_replica == 2
    assert config.engine_kwargs["enable_lora"] is True


@pytest.mark.parametrize(
    "engine_kwargs, cause",
    [
        ({"enforce_eager": True}, "enforce_eager=True"),
        ({"compilation_config": {"mode": 0}}, "compilation mode 0"),
        ({"enable_lora": True}, "LoRA"),
    ],
)
def test_pipeline_parallel_modes_that_cannot_serve_are_refused_by_name(model_dir, engine_kwargs, cause):
    from ray_train_tpu.serve import build_llm_config

    with pytest.raises(ValueError, match=f"pipeline_parallel_size 2 with {cause}.*cannot serve"):
        build_llm_config(model_dir, "2x2x2", "v4", simulate=True, pipeline_parallel_size=2,
                         engine_kwargs=engine_kwargs)
    # The same engine without pipeline parallelism, or compiled, can serve.
    assert build_llm_config(model_dir, "2x2x2", "v4", simulate=True, engine_kwargs=engine_kwargs)
    compiled = build_llm_config(model_dir, "2x2x2", "v4", simulate=True, pipeline_parallel_size=2)
    assert compiled.engine_kwargs["pipeline_parallel_size"] == 2
    # vllm-torchtpu is not vLLM's CPU backend: not refused there (untested on TPUs).
    assert build_llm_config(model_dir, "2x2x2", "v4", simulate=False, pipeline_parallel_size=2,
                            engine_kwargs=engine_kwargs)


def test_replicas_on_sub_slices_reserve_their_piece_themselves(model_dir):
    """engine_shape: Ray Serve LLM's own LLMConfig with our server_cls, which
    reserves the replica's piece and hands it to Ray Serve LLM's engine config
    (the private seam `use_placement_group`); by default one slice's worth of replicas."""
    from ray_train_tpu._compat import ray_llm as R
    from ray_train_tpu.serve import build_llm_config
    from ray_train_tpu.serve._subslice import SubsliceLLMServer

    config = build_llm_config(model_dir, "2x2x2", "v4", engine_shape="1x1x1", simulate=True)
    assert config.server_cls is SubsliceLLMServer and issubclass(SubsliceLLMServer, R.LLMServer)
    assert config.deployment_config["num_replicas"] == 8  # one slice of one-chip engines
    assert (config.engine_kwargs["tensor_parallel_size"], config.engine_kwargs["pipeline_parallel_size"]) == (1, 1)
    assert config.callback_config.callback_kwargs == {"topology": "2x2x2", "accelerator_type": "TPU-V4",
                                                      "engine_shape": "1x1x1"}
    engine = config.get_engine_config()
    assert engine.accelerator.requires_deferred_placement_group  # Serve reserves nothing for the replica
    released = []
    pg = object()
    R.use_placement_group(config, pg, lambda: released.append(True))
    # What Ray Serve LLM's get_or_create_pg asks for in a replica outside any group.
    assert "self.accelerator.create_placement_group(" in inspect.getsource(type(engine).get_or_create_pg)
    assert engine.accelerator.create_placement_group(bundles=engine.placement_bundles, strategy="PACK", name="",
                                                     accelerator_type_str="TPU-V4") is pg
    engine.accelerator.shutdown()
    engine.accelerator.shutdown()
    assert released == [True]
    host = build_llm_config(model_dir, "4x4", "TPU-V6E", engine_shape="2x2", simulate=False,
                            autoscaling_config={"min_replicas": 1, "max_replicas": 4})
    assert host.engine_kwargs["tensor_parallel_size"] == 4 and "num_replicas" not in host.deployment_config
    assert host.runtime_env["env_vars"]["TORCH_TPU_TOPOLOGY"] == "2,2,1"  # the engine's own piece
    from ray_train_tpu.serve.cli import config_json

    dumped = json.loads(json.dumps(config_json(config)))  # serve --print-config
    assert dumped["server_cls"] == "ray_train_tpu.serve._subslice.SubsliceLLMServer"
    whole = build_llm_config(model_dir, "2x2x2", "v4", engine_shape="2x2x2", simulate=True)
    assert whole.server_cls is None and whole.engine_kwargs["tensor_parallel_size"] == 8  # the whole-slice path
