"""Every touch of vLLM internals by serving, pinned to `constants.VLLM_VERSION`.

- `CpuPlatform` (``vllm.platforms.cpu``): the base of the simulated TPU platform;
  its ``check_and_update_config`` sets ``parallel_config.worker_cls`` to
  `CPU_WORKER`, which we replace.
- `CPUWorker` (``vllm.v1.worker.cpu_worker``): the base of the simulated slice
  worker; `WorkerBase` (``vllm.v1.worker.worker_base``), the base of vllm-torchtpu's
  ``TPUWorker``, tells which of its methods a TPU worker has.
- `RayWorkerProc` (``vllm.v1.executor.ray_executor_v2``): the Ray actor in which
  vLLM's own Ray executor (V2, the default) and vllm-torchtpu's start each
  worker. Both read the module's ``RayWorkerProc`` when they start workers, so
  `use_worker_proc` makes both start a subclass of ours instead;
  ``initialize_worker`` is where a worker gets its environment, before its
  device starts.
- `eager_pipeline_problem`: vLLM's CPU backend skips its warm-up in eager mode
  (``CPUModelRunner.warming_up_model`` returns at ``CompilationMode.NONE``), and
  that warm-up is what allocates the tensors later pipeline stages receive
  (``intermediate_tensors``): with PP > 1 every request then fails
  (``EngineDeadError``). LoRA forces eager mode on the CPU backend
  (``CpuPlatform.check_and_update_config``).

- rl: weight sync into rollout engines (the section below).

Importing this module imports no vLLM: the classes load on first use.
tests/unit/test_compat.py checks that each seam still exists in the installed vLLM.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSION = C.VLLM_VERSION

CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
RAY_EXECUTOR_V2_MODULE = "vllm.v1.executor.ray_executor_v2"
WORKER_PROC = RAY_EXECUTOR_V2_MODULE + ".RayWorkerProc"
# vLLM's switch between its Ray executors; only V2 starts workers in RayWorkerProc.
USE_RAY_V2_EXECUTOR = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
# vLLM's CompilationMode.NONE: no torch.compile (what enforce_eager=True means).
COMPILATION_MODE_NONE = 0

WORKER_BASE = "vllm.v1.worker.worker_base.WorkerBase"
GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
_LAZY = {"CpuPlatform": CPU_PLATFORM, "CPUWorker": CPU_WORKER, "RayWorkerProc": WORKER_PROC,
         "WorkerBase": WORKER_BASE, "GPUWorker": GPU_WORKER}
_ORIGINAL_WORKER_PROC: list = []


def _load(qualname: str) -> Any:
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name == "RayWorkerProc":
        return original_worker_proc()
    if name in _LAZY:
        return _load(_LAZY[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def original_worker_proc() -> type:
    """vLLM's own ``RayWorkerProc``, even after `use_worker_proc`."""
    if not _ORIGINAL_WORKER_PROC:
        _ORIGINAL_WORKER_PROC.append(_load(WORKER_PROC))
    return _ORIGINAL_WORKER_PROC[0]


def log_to_stderr() -> None:
    """Send vLLM's logs (stdout by default, which Ray forwards to a driver's
    stdout) to stderr in this process and the processes it starts, so that
    stdout stays data; unless ``VLLM_LOGGING_STREAM`` is set already. Call
    before vLLM is imported (it reads the variable then)."""
    if _environ.get(C.VLLM_LOGGING_STREAM) is None:
        _environ.update({C.VLLM_LOGGING_STREAM: "ext://sys.stderr"})


def warn_if_untested(name: str, installed: str, tested: str) -> bool:
    """Log once per process that `name` `installed` is not the version our seams were checked against."""
    if installed.split("+")[0] == tested or name in _WARNED:
        return False
    _WARNED.add(name)
    logger.warning("ray_train_tpu's %s seams were checked against %s %s, found %s; "
                   "tests/unit/test_compat.py tells whether they still hold", name, name, tested, installed)
    return True


_WARNED: set = set()


def use_worker_proc(cls: type) -> None:
    """Make vLLM's Ray executors (V2: vLLM's own and vllm-torchtpu's) start
    `cls`, a subclass of `original_worker_proc()`, for every worker. Idempotent."""
    import vllm

    warn_if_untested("vLLM", vllm.__version__, TESTED_VLLM_VERSION)
    original = original_worker_proc()
    if not issubclass(cls, original):
        raise TypeError(f"{cls!r} must subclass vLLM's RayWorkerProc")
    setattr(importlib.import_module(RAY_EXECUTOR_V2_MODULE), "RayWorkerProc", cls)


def worker_proc_rank(proc: Any) -> int:
    """The rank a ``RayWorkerProc`` was created for (its deferred init arguments)."""
    return int(proc._init_kwargs["rank"])


def replace_worker_cls(vllm_config: Any, old: str, new: str) -> None:
    """Run `new` as every worker where the platform chose `old`."""
    parallel = vllm_config.parallel_config
    if parallel.worker_cls == old:
        parallel.worker_cls = new


def eager_pipeline_problem(engine_kwargs: Mapping[str, Any], pipeline_parallel_size: int) -> Optional[str]:
    """Why vLLM's CPU backend (the simulated platform) cannot serve these engine
    arguments, or None: pipeline parallelism in eager mode (``enforce_eager``,
    a compilation mode of 0, or LoRA, which forces eager mode there)."""
    if pipeline_parallel_size <= 1:
        return None
    compilation = engine_kwargs.get("compilation_config")
    mode = compilation.get("mode", compilation.get("level")) if isinstance(compilation, Mapping) else compilation
    if engine_kwargs.get("enforce_eager"):
        cause = "enforce_eager=True"
    elif mode is not None and int(mode) == COMPILATION_MODE_NONE:
        cause = f"compilation mode {mode} (no compilation)"
    elif engine_kwargs.get("enable_lora"):
        cause = "LoRA (which vLLM's CPU backend runs in eager mode)"
    else:
        return None
    return (
        f"pipeline_parallel_size {pipeline_parallel_size} with {cause} cannot serve on the simulated TPU "
        f"platform: vLLM {TESTED_VLLM_VERSION}'s CPU backend skips its warm-up in eager mode, which is "
        "what allocates the tensors later pipeline stages receive, so every request would fail "
        "(EngineDeadError); leave enforce_eager out (compiled mode) or use pipeline_parallel_size=1"
    )


# --- rl: weight sync into rollout engines ----------------------------------------------
#
# Weights reach a rollout engine through vLLM's ``parallel_config.worker_extension_cls``
# (``vllm/v1/worker/worker_base.py``, ``WorkerWrapperBase.init_worker``): a mixin
# vLLM adds to *any* worker class, vLLM's CPU worker and vllm-torchtpu's
# ``TPUWorker`` alike (vLLM's weight-transfer API, ``LLM.update_weights`` & co.,
# lives on its GPU ``Worker`` only). Each worker (TP rank) loads the update with
# its model's ``load_weights`` (``model_runner.get_model()``, which TPUWorker's
# runner has too), between vLLM's layerwise-reload bracket
# (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), which re-runs
# each layer's post-load processing (on the CPU backend: the repacking of
# linear weights into oneDNN layouts).
#
# Parity reads back what the kernels compute with: a linear layer through its
# own ``quant_method.apply(layer, I)`` (exact: W^T), embeddings without vLLM's
# vocabulary padding, and, with tensor parallelism, which slice of each Hugging
# Face tensor this rank holds (`tp_pieces`), from the layers' own attributes.

LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
# One slice of a Hugging Face tensor held by a TP rank: (dim, start, length); None = all of it.
TPSpec = Optional[tuple[int, int, int]]


def reload_weights(worker, receive: Callable[[Callable], None]) -> None:
    """Load new weights into a vLLM worker's model in place: ``receive(load_weights)``
    calls ``load_weights(iterable of (hf_name, tensor))`` as often as it likes
    (one bucket at a time), between vLLM's layerwise-reload bracket."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker_model(worker)
    initialize_layerwise_reload(model)
    receive(model.load_weights)
    finalize_layerwise_reload(model, worker.model_config)


def logprobs_mode(model_config) -> str:
    """The engine's ``ModelConfig.logprobs_mode``."""
    return model_config.logprobs_mode


def set_logprobs_mode(model_config, mode: str) -> None:
    model_config.logprobs_mode = mode


def worker_model(worker) -> "torch.nn.Module":
    """The model a vLLM worker runs (``Worker.model_runner.get_model()``)."""
    return worker.model_runner.get_model()


def worker_place(worker) -> dict:
    """What a vLLM worker is: its rank in the engine and its TP rank/size."""
    from vllm.distributed import parallel_state

    return {"rank": int(worker.rank), "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size()}


def effective_weights(model) -> Iterator[tuple[str, "torch.Tensor", list[TPSpec]]]:
    """``(engine name, tensor, specs)`` for every weight as the model computes
    with it (a tensor shared by two modules, tied embeddings, once). The tensor
    is this TP rank's part; ``specs`` has one entry per Hugging Face piece of a
    fused tensor (q, k, v of ``qkv_proj``), in order, or one for a plain one."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    seen, covered = set(), []
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and getattr(module, "quant_method", None) is not None:
            covered.append(name + ".")
            specs = linear_specs(module)
            yield name + ".weight", _effective_weight(module), specs
            if getattr(module, "bias", None) is not None:
                yield name + ".bias", module.bias, specs if specs[0] is None or specs[0][0] == 0 else [None]
        elif isinstance(module, VocabParallelEmbedding):
            covered.append(name + ".")
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                idx = module.shard_indices
                rows = idx.org_vocab_end_index - idx.org_vocab_start_index
                # vLLM pads the vocabulary (to a multiple of 64): rows past it are not the model's.
                spec = None if module.tp_size == 1 else (0, idx.org_vocab_start_index, rows)
                yield name + ".weight", module.weight[:rows], [spec]
    for name, param in model.named_parameters():
        if not any(name.startswith(p) for p in covered) and id(param) not in seen:
            seen.add(id(param))
            yield name, param, [None]


def linear_specs(layer) -> list[TPSpec]:
    """Which slice of each Hugging Face piece a TP rank's linear layer holds."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)

    tp, rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    if isinstance(layer, QKVParallelLinear):
        kv_rank = rank // layer.num_kv_head_replicas
        q, kv, v = (layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size,
                    layer.num_kv_heads * layer.v_head_size)
        specs = [(0, rank * q, q), (0, kv_rank * kv, kv), (0, kv_rank * v, v)]
    elif isinstance(layer, MergedColumnParallelLinear):
        specs = [(0, rank * (s // tp), s // tp) for s in layer.output_sizes]
    elif isinstance(layer, ColumnParallelLinear):
        specs = [(0, rank * layer.output_size_per_partition, layer.output_size_per_partition)]
    elif isinstance(layer, RowParallelLinear):
        specs = [(1, rank * layer.input_size_per_partition, layer.input_size_per_partition)]
    else:
        specs = [None] * len(getattr(layer, "output_sizes", None) or [1])
    return [None] * len(specs) if tp == 1 else specs


def _effective_weight(layer) -> "torch.Tensor":
    """``W`` [out, in] of this rank's linear layer, computed by its own kernel."""
    import torch

    eye = torch.eye(layer.input_size_per_partition, dtype=layer.params_dtype, device=_device(layer))
    return layer.quant_method.apply(layer, eye).t().contiguous()


def _device(layer) -> "torch.device":
    import torch

    for t in list(layer.parameters()) + list(layer.buffers()):
        if t.numel():
            return t.device
    return torch.device("cpu")


def packed_modules(model) -> dict:
    """``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}``: the model's fused modules."""
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


# --- a clean engine shutdown logs no error (issue 33) ---------------------------------
# vLLM 0.29's ``AsyncLLM.shutdown`` shuts the engine core client down first, which
# cancels its output-queue task; that task answers its cancellation by queueing an
# ``EngineDeadError`` (``core_client.AsyncMPClient``, ``process_outputs_socket``), which
# the still running output handler reads and logs with its traceback ("AsyncLLM
# output_handler failed.") before ``shutdown`` cancels the handler too. Cancelling
# the handler first, as this does, lets the shutdown run without that error.


def cancel_output_handler(engine: Any) -> bool:
    """Cancel an ``AsyncLLM``'s output handler task (thread-safe; from its loop
    or another thread) before its ``shutdown``; False if it has none running."""
    from vllm.utils.async_utils import cancel_task_threadsafe

    handler = getattr(engine, "output_handler", None)
    if handler is None or handler.done():
        return False
    cancel_task_threadsafe(handler)
    return True
