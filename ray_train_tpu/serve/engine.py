"""One vLLM engine on one whole TPU slice, checked before anything starts: the
part that serving (`builder`) and batch inference (`batch`) share.

`slice_engine` sizes TP x PP to the slice and the model (`spec`), refuses what
cannot run (another executor than Ray's; on the simulated platform, pipeline
parallelism in eager mode, which vLLM's CPU backend cannot serve), and gives
the engine's and its workers' environment: simulated (vLLM's CPU kernels,
gloo over loopback) or vllm-torchtpu's Ray executor.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._compat import vllm as V
from ray_train_tpu._compat import vllm_torchtpu as T
from ray_train_tpu.serve.models import model_shape
from ray_train_tpu.serve.spec import SliceServeSpec

# Per-worker KV cache in simulation (CPU memory; vLLM's CPU default is 4 GiB).
SIMULATED_KV_CACHE_BYTES = 256 * 2**20

# Every engine and vLLM worker: libtpu never asks for a metadata server, and
# vLLM's Ray executor V2, which starts workers where we check them.
ENGINE_ENV = {C.TPU_SKIP_MDS_QUERY: "1", V.USE_RAY_V2_EXECUTOR: "1"}
# vLLM's CPU backend keeps the engine core in the engine's own process (it lives and dies with its actor).
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Simulation: gloo over loopback (each simulated host is a loopback address),
# no CPU pinning (the hosts share the machine's cores), torch_tpu not autoloaded.
SIMULATED_ENV = {
    C.RAY_TRAIN_TPU_SIMULATE: "1",
    C.TORCH_DEVICE_BACKEND_AUTOLOAD: "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceEngine:
    """What a vLLM engine on one slice runs with."""

    spec: SliceServeSpec  # or, for an engine on a sub-slice, a `subslice.SubsliceServeSpec`
    engine_kwargs: dict  # vLLM engine arguments, TP/PP and the executor included
    env: dict  # environment of the engine and its workers
    simulated: bool
    # One device, held by the engine's own actor: vLLM's worker runs in the
    # engine core (no Ray executor, no worker actors; `slice_engine(chip_in_actor=)`).
    chip_in_actor: bool = False

    @property
    def on_piece(self) -> bool:
        """The engine runs on an ``engine_shape`` piece of a slice, not a whole one."""
        return hasattr(self.spec, "engine_shape")

    @property
    def num_devices(self) -> int:
        return self.spec.tensor_parallel_size * self.spec.pipeline_parallel_size

    @property
    def strategy(self) -> str:
        """Placement strategy of the slice's bundles: a one-host slice has no
        slice-name label to pin them, so they are packed onto one host."""
        topo = self.spec.engine if self.on_piece else self.spec.parsed
        return "STRICT_PACK" if topo.num_hosts == 1 else "SPREAD"


def engine_env(*, simulated: bool, ray_executor: bool, offline: bool = False,
               torch_tpu_topology: Optional[str] = None) -> dict:
    """The environment of one vLLM engine and its workers, for serving, batch
    inference and RL alike.

    ``ray_executor``: the engine's workers are Ray actors (vLLM's Ray executor,
    on one or several hosts). vllm-torchtpu picks its executor from
    ``TPU_MULTIHOST_BACKEND`` alone (`_torchtpu_rules.torchtpu_executor`;
    ``distributed_executor_backend`` is ignored), so that is set here, on TPUs and
    in simulation alike (the simulated platform follows the same rule);
    without it a one-device engine runs in its own process (``"uni"``).
    ``offline``: the model is a local directory (no Hugging Face Hub calls).
    ``torch_tpu_topology``: the slice's TorchTPU topology, which vllm-torchtpu
    reads before its own per-size table (TPUs only)."""
    env = dict(ENGINE_ENV)
    if ray_executor:
        env.update(T.EXECUTOR_ENV)
    if offline:
        env[C.HF_HUB_OFFLINE] = "1"
    if simulated:
        env.update(SIMULATED_ENV)
    elif torch_tpu_topology:
        env[C.TORCH_TPU_TOPOLOGY] = torch_tpu_topology
    return env


def simulate_default(simulate: Optional[bool]) -> bool:
    return _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1" if simulate is None else bool(simulate)


def slice_engine(
    model: str,
    topology: str,
    accelerator_type: str,
    *,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    engine_kwargs: Optional[Mapping[str, Any]] = None,
    simulate: Optional[bool] = None,
    engine_shape: Optional[str] = None,
    chip_in_actor: bool = False,
) -> SliceEngine:
    """Check and complete one slice engine's configuration (ValueError naming
    the field, value, rule and fix when it cannot run). ``engine_shape``: the
    engine runs on that piece of a `topology` slice (`subslice`), not on a
    whole one (the slice's own topology is a whole one). ``chip_in_actor``: an
    engine of one device runs its vLLM worker in its own engine core, in the
    actor that holds the chip (vllm-torchtpu's choice for one device without
    ``TPU_MULTIHOST_BACKEND``: `_torchtpu_rules.torchtpu_executor`), as a
    one-chip RL rollout engine does; an engine of more devices ignores it and
    keeps vLLM's Ray executor."""
    kwargs = dict(engine_kwargs or {})
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if value is not None and kwargs.get(name, value) != value:
            raise ValueError(f"{name} is {value!r} but engine_kwargs[{name!r}] is {kwargs[name]!r}; give it once")
        if value is not None:
            kwargs[name] = value
    if kwargs.get("distributed_executor_backend", "ray") not in ("ray", None):
        raise ValueError(
            f"engine_kwargs distributed_executor_backend {kwargs['distributed_executor_backend']!r}: "
            "an engine's workers span the slice's hosts, which needs vLLM's Ray executor ('ray'); remove it"
        )
    sizes = dict(tensor_parallel_size=kwargs.get("tensor_parallel_size"),
                 pipeline_parallel_size=kwargs.get("pipeline_parallel_size"))
    spec, engine_topo = None, None
    if engine_shape is not None:
        from ray_train_tpu.serve.subslice import SubsliceServeSpec

        sub = SubsliceServeSpec(accelerator_type=accelerator_type, topology=topology, engine_shape=engine_shape,
                                model=model_shape(model), **sizes)
        if not sub.whole_slice:
            spec, engine_topo = sub, sub.engine
    if spec is None:
        spec = SliceServeSpec(accelerator_type=accelerator_type, topology=topology, model=model_shape(model), **sizes)
        engine_topo = spec.parsed
    in_actor = bool(chip_in_actor) and spec.tensor_parallel_size * spec.pipeline_parallel_size == 1
    kwargs.update(tensor_parallel_size=spec.tensor_parallel_size,
                  pipeline_parallel_size=spec.pipeline_parallel_size,
                  distributed_executor_backend="uni" if in_actor else "ray")
    simulated = simulate_default(simulate)
    env = engine_env(simulated=simulated, ray_executor=not in_actor, offline=os.path.isdir(model),
                     torch_tpu_topology=engine_topo.torch_tpu_topology)
    if simulated:
        problem = V.eager_pipeline_problem(kwargs, spec.pipeline_parallel_size)
        if problem:
            raise ValueError(problem)
        kwargs.setdefault("kv_cache_memory_bytes", SIMULATED_KV_CACHE_BYTES)
    return SliceEngine(spec=spec, engine_kwargs=kwargs, env=env, simulated=simulated, chip_in_actor=in_actor)


def with_env(runtime_env: Optional[Mapping[str, Any]], env: Mapping[str, str]) -> dict:
    """`runtime_env` with `env` under its ``env_vars`` (the caller's values win)."""
    out = dict(runtime_env or {})
    out["env_vars"] = {**env, **out.get("env_vars", {})}
    return out
