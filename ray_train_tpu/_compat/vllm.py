"""Every touch of vLLM internals by serving, pinned to `constants.VLLM_VERSION`.

- `CpuPlatform` (``vllm.platforms.cpu``): the base of the simulated TPU platform;
  its ``check_and_update_config`` sets ``parallel_config.worker_cls`` to
  `CPU_WORKER`, which we replace.
- `CPUWorker` (``vllm.v1.worker.cpu_worker``): the base of the simulated slice worker.
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

Importing this module imports no vLLM: the classes load on first use.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Mapping, Optional

from ray_train_tpu import constants as C

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

_LAZY = {"CpuPlatform": CPU_PLATFORM, "CPUWorker": CPU_WORKER, "RayWorkerProc": WORKER_PROC}
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
