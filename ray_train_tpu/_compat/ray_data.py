"""Ray Data's and Ray Data LLM's internals that we lean on, pinned to
`constants.RAY_VERSION`; tests/unit/test_compat.py reads each from Ray's own
source.

Batch inference (Ray Data LLM, ``ray.data.llm.build_processor``):

- `vLLMEngineStageUDF` / `vLLMEngineStage`: the class whose actors run the vLLM
  engine (we subclass it), and its stage. Loaded on first use: their module
  imports vLLM when vLLM can be imported.
- `engine_stage` / `place_engines`: the processor's vLLM stage, and where its
  engine actors go. Ray's stage asks ``ray_remote_args_fn`` for the scheduling
  strategy of every engine actor it starts (its own makes a GPU placement
  group); ours reserves a TPU slice or a piece of one instead.
- `vllm_left_to_engines`: build a processor in the driver as Ray Data LLM
  builds one where vLLM is not installed (a CPU-only head). Ray defers vLLM to
  the engine actors except for one guarded import (``VLLM_FATAL_ERRORS``, read
  only where an engine runs); the driver otherwise imports vLLM (4-6 s of CPU)
  for nothing before any engine can start.

- `starting_an_actor`: whether a map stage's ``ray_remote_args_fn`` is being
  called to start one of the stage's actors (``ActorPoolMapOperator._start_actor``)
  or for something else (the high-memory issue detector, which calls every map
  stage's function to read its ``memory`` request). Batch inference's function
  reserves a slice per call (`serve.batch.engine_remote_args`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

__all__ = [
    "ACTOR_START", "ENGINE_STAGE_NAME", "build_processor", "engine_stage", "place_engines", "starting_an_actor",
    "vLLMEngineProcessorConfig", "vLLMEngineStage", "vLLMEngineStageUDF", "vllm_left_to_engines",
]

# The module of Ray Data LLM's vLLM stage, and the one import of vLLM it makes
# at import time (guarded by ``except ImportError``, for a driver without vLLM).
STAGE_MODULE = "ray.llm._internal.batch.stages.vllm_engine_stage"
VLLM_GUARDED_IMPORTER = "ray.llm._internal.common.errors"
# Ray Data LLM names a processor's stages by class (``Processor._append_stage``).
ENGINE_STAGE_NAME = "vLLMEngineStage"

# Where Ray Data starts an actor of an actor-pool map stage, calling the stage's
# ``ray_remote_args_fn`` (through ``_merge_ray_remote_args``) for its remote args.
ACTOR_START = ("actor_pool_map_operator.py", "_start_actor")


def starting_an_actor() -> bool:
    """Whether this call (a stage's ``ray_remote_args_fn``) is Ray Data starting
    an actor of the stage. Ray Data calls the function for other reasons too:
    its high-memory issue detector calls every map stage's function when the
    execution starts and periodically after (``_get_dynamic_ray_remote_args``),
    only to read a ``memory`` request. A function that reserves a slice per
    call must reserve only here."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == ACTOR_START[1] and code.co_filename.endswith(ACTOR_START[0]):
            return True
        frame = frame.f_back
    return False


def __getattr__(name: str) -> Any:
    # Ray Data LLM's public builder is light; its vLLM stage module is not.
    if name in ("build_processor", "vLLMEngineProcessorConfig"):
        import ray.data.llm

        return getattr(ray.data.llm, name)
    if name in ("vLLMEngineStage", "vLLMEngineStageUDF"):
        import importlib

        return getattr(importlib.import_module(STAGE_MODULE), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def engine_stage(processor: Any) -> Any:
    """The vLLM engine stage of a Ray Data LLM processor."""
    return processor.get_stage_by_name(ENGINE_STAGE_NAME)


def place_engines(processor: Any, udf_cls: type, remote_args_fn: Callable[[], dict], **udf_kwargs: Any) -> None:
    """Run the processor's engines as `udf_cls` (a `vLLMEngineStageUDF`
    subclass, given `udf_kwargs` too), each in the placement group that
    `remote_args_fn` returns the scheduling strategy of (and, for an engine
    holding its one chip, that chip). The engine actor asks for no CPU (it runs
    in its slice, whose bundles hold only chips) and no GPU (Ray Data LLM gives
    a one-device engine ``num_gpus=1``, its "uni" executor's device)."""
    import ray

    from ray_train_tpu import constants as C
    from ray_train_tpu._compat.vllm import warn_if_untested

    warn_if_untested("Ray Data LLM", ray.__version__, C.RAY_VERSION)
    if not issubclass(udf_cls, __getattr__("vLLMEngineStageUDF")):
        raise TypeError(f"{udf_cls!r} must subclass Ray Data LLM's vLLMEngineStageUDF")
    stage = engine_stage(processor)
    stage.fn = udf_cls
    stage.fn_constructor_kwargs.update(udf_kwargs)
    stage.map_batches_kwargs["ray_remote_args_fn"] = remote_args_fn
    stage.map_batches_kwargs["num_cpus"] = 0
    stage.map_batches_kwargs["num_gpus"] = 0


class _RefuseVllm:
    """A meta-path finder that says vLLM is not installed, and remembers who
    asked (by the importing module's name)."""

    def __init__(self):
        self.asked_by: set = set()

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
                frame = frame.f_back
            self.asked_by.add(frame.f_globals.get("__name__") if frame is not None else None)
            raise ModuleNotFoundError(f"No module named {name!r} (left to the engine actors)", name=name)
        return None


@contextlib.contextmanager
def vllm_left_to_engines() -> Iterator[set]:
    """Within this block, this process imports Ray Data LLM's stage as a driver
    without vLLM would: Ray's guarded import finds no vLLM and the engine
    actors, which unpickle the stage there, import vLLM themselves. Yields the
    names of the modules that asked for vLLM (tests: only Ray's guarded one).

    A process that has imported vLLM already keeps it (nothing is refused).
    Afterwards Ray's guarded module is forgotten, so that a later importer in
    this process (Ray Serve LLM) gets vLLM's errors; the stage module keeps the
    empty tuple it read, which only an engine (never the driver) uses.
    """
    if "vllm" in sys.modules or STAGE_MODULE in sys.modules:
        yield set()
        return
    finder = _RefuseVllm()
    sys.meta_path.insert(0, finder)
    try:
        yield finder.asked_by
    finally:
        sys.meta_path.remove(finder)
        if "vllm" not in sys.modules:
            guarded = sys.modules.pop(VLLM_GUARDED_IMPORTER, None)
            package, _, attr = VLLM_GUARDED_IMPORTER.rpartition(".")
            if guarded is not None and getattr(sys.modules.get(package), attr, None) is guarded:
                delattr(sys.modules[package], attr)
