"""The simulated TPU platform's rules against vllm-torchtpu 0.29.0's own code
(`ray_train_tpu.serve._torchtpu_rules`): its functions run here where they can
(compiled from its source, TPU libraries replaced), its source read where they
cannot. A version bump that changes a rule fails here. The source comes from
the cache ``make setup`` fills; these tests never fetch it."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import itertools
import os
import types

import pytest
import torch

from ray_train_tpu import constants as C
from ray_train_tpu.serve import _torchtpu_rules as R
from ray_train_tpu.serve import _torchtpu_source as S

PLATFORM = "platforms/tpu_platform.py"
WORKER = "worker/tpu_worker.py"
RUNNER = "runner/tpu_runner.py"


@pytest.fixture(scope="module")
def src():
    return S.source_dir(fetch=False)


# --- requests: seeded sampling


def test_requests_are_refused_exactly_as_vllm_torchtpu_refuses_them(src, vllm_importable):
    from vllm import SamplingParams
    from vllm.pooling_params import PoolingParams

    from ray_train_tpu.serve._vllm_sim import SimulatedTPUPlatform

    theirs = S.compile_function(S.method_def(src, PLATFORM, "TpuPlatform.validate_request"), {})
    cases = [SamplingParams(temperature=t, seed=seed, n=n, top_k=k)
             for t, seed, n, k in itertools.product((0.0, 0.7, 1.0), (None, 0, 1234), (1, 4), (0, 5))
             if t > 0 or n == 1]  # greedy sampling takes n = 1
    cases.append(PoolingParams())
    refused = 0
    for params in cases:
        try:
            theirs(None, None, params)
            their_error = None
        except Exception as e:  # noqa: BLE001 (whatever it raises, ours must raise alike)
            their_error = e
        if their_error is None:
            SimulatedTPUPlatform.validate_request(None, params)  # accepted there: accepted here
            continue
        refused += 1
        with pytest.raises(type(their_error)) as ours:
            SimulatedTPUPlatform.validate_request(None, params)
        assert str(ours.value).startswith(str(their_error)), (params, str(ours.value))
    assert refused == 2 * 2 * 2 * 2  # every seeded request at temperature > 0, nothing else


# --- the executor


def _their_executor_choice(src):
    """vllm-torchtpu's executor choice: the statements of TpuPlatform.check_and_update_config
    from ``multihost_backend = envs.TPU_MULTIHOST_BACKEND`` through the ``if`` after it, as written."""
    body = S.method_def(src, PLATFORM, "TpuPlatform.check_and_update_config").body
    start = next(i for i, n in enumerate(body) if isinstance(n, ast.Assign)
                 and ast.unparse(n.value) == "envs.TPU_MULTIHOST_BACKEND")
    assert isinstance(body[start + 1], ast.If)
    namespace = {"__builtins__": {**vars(builtins), "__import__": S.stub_import()}}
    return S.statements_function(body[start:start + 2], ["envs", "vllm_envs", "parallel_config", "pcp_size", "cls",
                                                         "os", "logger", "portpicker"],
                                 "parallel_config.distributed_executor_backend", namespace)


def _parallel(nnodes, tp, pp, dp, pcp, backend):
    return types.SimpleNamespace(nnodes=nnodes, node_rank=0, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 data_parallel_size=dp, prefill_context_parallel_size=pcp,
                                 distributed_executor_backend=backend, enable_expert_parallel=False,
                                 data_parallel_master_ip="127.0.0.1", world_size=tp * pp,
                                 world_size_across_dp=tp * pp * dp)


def _outcome(fn):
    try:
        return ("ok", str(fn()))
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def test_the_executor_is_chosen_as_vllm_torchtpu_chooses_it(src):
    theirs = _their_executor_choice(src)
    stub = types.SimpleNamespace(_prepare_singlehost_tpu_env=lambda n: None, device_control_env_var="")
    log = types.SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    chosen = set()
    for backend, v2, nnodes, tp, pp, dp, pcp, given in itertools.product(
            ("", "mp", "ray"), (False, True), (1, 2), (1, 2), (1, 2), (1, 2), (1, 2), (None, "ray", "mp")):
        fake_os = types.SimpleNamespace(environ={})
        their = _outcome(lambda: theirs(types.SimpleNamespace(TPU_MULTIHOST_BACKEND=backend),
                                        types.SimpleNamespace(VLLM_USE_RAY_V2_EXECUTOR_BACKEND=v2),
                                        _parallel(nnodes, tp, pp, dp, pcp, given), pcp, stub, fake_os, log,
                                        types.SimpleNamespace(pick_unused_port=lambda: 1)))
        ours = _outcome(lambda: R.torchtpu_executor(backend, v2, _parallel(nnodes, tp, pp, dp, pcp, given)))
        assert ours == their, (backend, v2, nnodes, tp, pp, dp, pcp, given)
        chosen.add(their[1] if their[0] == "ok" else their[0])
    assert chosen == {R.UNIPROC, R.MULTIPROC, R.RAY_V2, R.RAY_V1, "NotImplementedError"}


def test_tpu_multihost_backend_is_read_as_vllm_torchtpu_reads_it(src, monkeypatch):
    spec = importlib.util.spec_from_file_location("_their_envs", os.path.join(src, S.PACKAGE, "envs.py"))
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    for value in (None, "ray", "mp", "", "RAY", "slurm"):
        env = {} if value is None else {R.MULTIHOST_BACKEND_ENV: value}
        if value is None:
            monkeypatch.delenv(R.MULTIHOST_BACKEND_ENV, raising=False)
        else:
            monkeypatch.setenv(R.MULTIHOST_BACKEND_ENV, value)
        their, ours = _outcome(lambda: envs.TPU_MULTIHOST_BACKEND), _outcome(lambda: R.multihost_backend(env))
        assert their[0] == ours[0] and (their[0] != "ok" or their == ours), (value, their, ours)


def test_engines_get_the_executor_env_and_the_simulation_follows_it(tmp_path):
    import json

    from ray_train_tpu._compat import vllm_torchtpu as T
    from ray_train_tpu.rl.rollout import engine_env as rl_engine_env
    from ray_train_tpu.serve._vllm_sim import apply_executor_rule
    from ray_train_tpu.serve.engine import slice_engine

    for simulated in (True, False):
        tp8 = rl_engine_env(8, simulated)  # the GSM8K example's TP 8 engine across two hosts
        assert tp8[R.MULTIHOST_BACKEND_ENV] == "ray" and T.EXECUTOR_ENV.items() <= tp8.items()
        assert R.MULTIHOST_BACKEND_ENV not in rl_engine_env(1, simulated)  # one chip: its own process
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4}))
    served = slice_engine(str(tmp_path), "2x2x2", "TPU-V4", tensor_parallel_size=8, simulate=True).env
    assert T.EXECUTOR_ENV.items() <= served.items()
    for env, tp, nnodes, want in ((rl_engine_env(8, True), 8, 2, "ray"), (rl_engine_env(1, True), 1, 1, "uni"),
                                  (served, 8, 2, "ray"), ({}, 2, 1, "mp")):
        parallel = _parallel(nnodes, tp, 1, 1, 1, "ray" if want != "ray" else None)
        os_env = {k: v for k, v in env.items()}
        old = dict(os.environ)
        try:
            os.environ.pop(R.MULTIHOST_BACKEND_ENV, None)
            os.environ.update(os_env)
            apply_executor_rule(parallel)  # distributed_executor_backend given: ignored
        finally:
            os.environ.clear()
            os.environ.update(old)
        assert parallel.distributed_executor_backend == want
    with pytest.raises(ValueError, match="TPU_MULTIHOST_BACKEND=ray"):
        R.simulated_executor(_parallel(2, 8, 1, 1, 1, None), {})


# --- log-probs


def _their_gather_logprobs(src, max_logprobs=0):
    from vllm.v1.outputs import LogprobsTensors

    fn = S.compile_function(S.method_def(src, RUNNER, "TPUModelRunner.gather_logprobs"),
                            {"torch": torch, "LogprobsTensors": LogprobsTensors})
    runner = types.SimpleNamespace(model_config=types.SimpleNamespace(max_logprobs=max_logprobs))
    return lambda logits, tokens: fn(runner, logits, tokens)


def test_logprobs_are_of_the_raw_logits_as_on_tpu(src, vllm_importable):
    from vllm.v1.sample.sampler import Sampler

    from ray_train_tpu.serve._vllm_sim import apply_logprobs_rule

    # vllm-torchtpu never reads logprobs_mode ...
    for root, _, files in os.walk(os.path.join(src, S.PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    assert "logprobs_mode" not in f.read(), os.path.join(root, name)
    # ... and gathers them from the logits the sampler gets before its temperatures
    runner = S.parse(src, RUNNER)
    calls = 0
    for fn in ast.walk(runner):
        if not isinstance(fn, ast.FunctionDef) or fn.name == "gather_logprobs":
            continue
        gathers = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.gather_logprobs"]
        samples = [n for n in ast.walk(fn) if isinstance(n, ast.Call)
                   and ast.unparse(n.func) == "self.sample_from_logits_func"]
        for call in gathers if samples else ():
            calls += 1
            name = ast.unparse(call.args[0])
            assert name == ast.unparse(samples[0].args[0]) == "logits"
            assert any("temperature" in ast.unparse(a) for a in samples[0].args[1:])
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and name in [ast.unparse(t) for t in node.targets]:
                    assert "temperature" not in ast.unparse(node.value), ast.unparse(node)
    assert calls >= 1
    # its formula gives what vLLM's raw_logprobs gives (the simulated engine's)
    torch.manual_seed(0)
    logits = torch.randn(5, 97) * 4
    tokens = torch.randint(0, 97, (5, 1))
    got = _their_gather_logprobs(src)(logits, tokens).logprobs
    want = Sampler.compute_logprobs(logits).gather(-1, tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps * logits.abs().max().item())
    for mode in ("processed_logprobs", "raw_logits", "raw_logprobs"):
        model = types.SimpleNamespace(logprobs_mode=mode)
        apply_logprobs_rule(model)
        assert model.logprobs_mode == R.LOGPROBS_MODE == "raw_logprobs"


# --- the worker's methods


def test_the_worker_has_tpu_workers_methods_not_the_gpu_workers(src, vllm_importable):
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.worker_base import WorkerBase

    from ray_train_tpu.rl._vllm_worker import WeightSyncExtension
    from ray_train_tpu.serve._vllm_sim_worker import SliceCPUWorker

    tree = S.parse(src, WORKER)
    assert [ast.unparse(b) for b in S.class_def(tree, "TPUWorker").bases] == ["WorkerBase"]
    assert "from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase" in ast.unparse(tree)
    their_methods = S.class_methods(src, WORKER, "TPUWorker")
    assert R.TPU_WORKER_METHODS == their_methods
    hidden = R.gpu_only_methods(CPUWorker, WorkerBase, their_methods)
    assert SliceCPUWorker._torchtpu_hidden == hidden
    assert {"init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
            "sleep", "wake_up"} <= hidden
    worker = object.__new__(SliceCPUWorker)
    for name in hidden:
        assert not hasattr(SliceCPUWorker, name), name
        with pytest.raises(NotImplementedError, match=name):
            run_method(worker, name, (), {})  # what vLLM's collective_rpc does on every worker
    # nothing a TPUWorker has is hidden
    tpu = their_methods | {n for n in dir(WorkerBase) if not n.startswith("__")}
    assert all(hasattr(SliceCPUWorker, n) for n in tpu & set(dir(CPUWorker)))
    # what stays of the GPU worker's extras: only what the kept methods call themselves
    extras = {n for n in dir(CPUWorker) if not n.startswith("_") and callable(getattr(CPUWorker, n))} - tpu
    kept = [n for n in dir(CPUWorker) if n not in hidden and callable(getattr(CPUWorker, n, None))]
    called = set().union(*(R._self_calls(CPUWorker, n) for n in kept))
    assert extras - hidden <= called and len(extras - hidden) < len(hidden), extras - hidden
    # RL's extension mixes in without a clash (vLLM's own check in WorkerWrapperBase.init_worker)
    assert not [a for a in dir(WeightSyncExtension) if not a.startswith("__") and hasattr(SliceCPUWorker, a)]


# --- RL on those rules: temperature


def test_temperature_correction_equals_the_trainers_recomputation(src, vllm_importable):
    from ray_train_tpu.rl.grpo import token_logprobs
    from ray_train_tpu.rl.temperature import tempered_logprobs

    torch.manual_seed(1)
    batch, width, vocab, temperature = 3, 9, 151, 0.7
    logits = torch.randn(batch, width, vocab) * 3
    ids = torch.randint(0, vocab, (batch, width))
    mask = torch.zeros(batch, width)
    mask[:, 4:] = 1.0
    # the engine's log-probs: vllm-torchtpu's gather_logprobs on the raw logits at t - 1
    gather = _their_gather_logprobs(src)
    raw = torch.zeros(batch, width)
    for t in range(1, width):
        raw[:, t] = gather(logits[:, t - 1], ids[:, t:t + 1]).logprobs[:, 0]
    raw = raw * mask
    corrected = tempered_logprobs(raw, logits, temperature, mask)
    trainer = token_logprobs(logits, ids, temperature) * mask  # the trainer's recomputation
    # float32: a few roundings of values up to max|l| / T + log V
    bound = 16 * torch.finfo(torch.float32).eps * (logits.abs().max().item() / temperature + torch.log(
        torch.tensor(float(vocab))).item())
    torch.testing.assert_close(corrected, trainer, rtol=0, atol=bound)
    assert (raw - trainer).abs().max() > 100 * bound  # uncorrected, they differ
    assert tempered_logprobs(raw, logits, 1.0, mask) is raw


def test_engine_seeds_differ_per_engine_and_restart():
    from ray_train_tpu.rl.rollout import engine_seed

    seeds = {engine_seed(s, e, i) for s in (0, 7) for e in range(8) for i in range(3)}
    assert len(seeds) == 2 * 8 * 3 and all(0 <= x < 2**31 for x in seeds)


def test_the_trainer_turns_a_batchs_raw_engine_logprobs_into_the_samplers():
    from ray_train_tpu.rl.grpo import build_batch, token_logprobs
    from ray_train_tpu.rl.temperature import engine_logprobs_at_temperature

    torch.manual_seed(2)
    vocab, temperature = 50, 0.7
    embed, head = torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab)

    def model(input_ids, attention_mask):
        return types.SimpleNamespace(logits=head(torch.tanh(embed(input_ids))) * 4)

    prompts, completions = [[3, 4, 5], [6, 7], [8]], [[9, 10], [11, 12, 13], [14]]
    ids = build_batch(prompts, completions, [0.0] * 3, pad_id=0).input_ids
    with torch.no_grad():
        logits = model(ids, None).logits
    raw = token_logprobs(logits, ids, 1.0)  # what the engine reports (raw logits; same weights)
    batch = build_batch(prompts, completions, [0.0] * 3, pad_id=0,
                        completion_logprobs=[raw[i, len(p):len(p) + len(c)].tolist()
                                             for i, (p, c) in enumerate(zip(prompts, completions))])
    out = engine_logprobs_at_temperature(model, batch, temperature, micro_batch_size=2)
    want = token_logprobs(logits, ids, temperature) * batch.loss_mask  # the sampler's, recomputed
    bound = 16 * torch.finfo(torch.float32).eps * (logits.abs().max().item() / temperature + 4.0)
    torch.testing.assert_close(out.engine_logprobs, want, rtol=0, atol=bound)
    assert engine_logprobs_at_temperature(model, batch, 1.0) is batch


def test_rl_weight_loading_path_exists_on_tpu_worker(src, vllm_importable):
    """RL loads weights with ``worker.model_runner.get_model().load_weights`` and the
    worker's ``model_config`` (`ray_train_tpu._compat.vllm.reload_weights`): all there on TPUWorker."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    from ray_train_tpu._compat import vllm as V

    get_model = S.method_def(src, WORKER, "TPUWorker.get_model")
    assert ast.unparse(get_model.body[-1]) == "return self.model_runner.get_model()"
    runner = S.parse(src, RUNNER)
    assert [ast.unparse(b) for b in S.class_def(runner, "TPUModelRunner").bases] == ["GPUModelRunner"]
    assert "from vllm.v1.worker.gpu_model_runner import GPUModelRunner" in ast.unparse(runner)
    assert "get_model" not in S.class_methods(src, RUNNER, "TPUModelRunner")  # vLLM's own: returns self.model
    assert "return self.model" in inspect.getsource(GPUModelRunner.get_model)
    load = ast.unparse(S.method_def(src, RUNNER, "TPUModelRunner.load_model"))
    assert "model_loader.load_model" in load and "self.model = model" in load  # a vLLM model: load_weights
    assert "self.model_config = vllm_config.model_config" in inspect.getsource(WorkerBase.__init__)
    assert "worker.model_config" in inspect.getsource(V.reload_weights)
    assert "worker.model_runner.get_model()" in inspect.getsource(V.worker_model)
