"""Batch inference on TPU slices: a Ray Dataset of prompts through Ray Data
LLM's vLLM processor (``ray.data.llm``), one engine per whole slice or
several per slice (``engine_shape``, the layout planner's sub-slices).

An engine of several devices owns its slice (or its ``engine_shape`` piece of
one), one vLLM worker per device (TP x PP = the piece's devices, across its
hosts), laid out as a serving replica is: one ``{"TPU": 1}`` bundle per chip
(Ray's ``SlicePlacementGroup`` for a whole slice, `pieces.reserve_engine_slice`
for a piece), ranks in TPU-worker-id order, every worker's environment checked
before its device starts, the same vLLM platform plugin. An engine of one
device holds its chip in its own actor and runs vLLM's worker in its engine
core (as vllm-torchtpu does for one device, and as an RL rollout engine does):
no Ray executor, no worker actors. ``num_slices`` x ``engines_per_slice``
engines; Ray Data spreads the batches over them and retries a batch whose
engine died (the engine restarts in its reservation).
Every output row carries the input row's columns, ``generated_text``,
``generated_token_ids``, ``num_input_tokens``, ``num_generated_tokens`` and
``slice`` (the slice that served it).

Example:
    >>> import ray                                                        # doctest: +SKIP
    >>> from ray_train_tpu.serve.batch import BatchConfig, run_batch
    >>> config = BatchConfig(model="/models/Qwen2.5-0.5B-Instruct", topology="4x4",  # doctest: +SKIP
    ...                      accelerator_type="TPU-V6E", num_slices=2, max_tokens=128)
    >>> ds = ray.data.from_items([{"prompt": "The capital of France is"}])  # doctest: +SKIP
    >>> run_batch(config, ds).take_all()[0]["generated_text"]            # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from typing import Any, Mapping, Optional

from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.serve.engine import SliceEngine, slice_engine, with_env
from ray_train_tpu.serve.models import model_context_length

logger = logging.getLogger(__name__)

SLICE_COLUMN = "slice"
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_input_tokens", "num_generated_tokens", SLICE_COLUMN)
_WHERE = "BatchConfig"
# How long the cluster check waits for intact slices to show as idle.
IDLE_SETTLE_S = 5.0
# After the last row: how long the engines get to shut down by themselves (Ray
# Data drops its actors once the dataset is done) before their slices are taken
# back, which would kill their vLLM workers under them (an EngineDeadError).
ENGINE_EXIT_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """A batch inference job, checked before anything is reserved.

    Args:
        model: Hugging Face model directory (as every TPU host sees it) or id.
        topology, accelerator_type: the slices, e.g. ``"4x4"``, ``"TPU-V6E"``.
        num_slices: slices the job fills.
        engine_shape: each engine's piece of a slice (``"1x1"``: one v6e chip,
            ``"2x2x1"``: one v4 host, ...; ``batch --plan`` prints the one the
            model needs); default: one engine per whole slice.
        engines_per_slice: engines on each slice; default: as many
            ``engine_shape`` pieces as one slice holds.
        prompt_column: the dataset's column of prompt texts.
        max_tokens, temperature: vLLM sampling; ``temperature=0`` is greedy.
        sampling_params: more ``vllm.SamplingParams`` fields (``top_p``,
            ``stop``, ...). No per-request ``seed`` when sampling: vllm-torchtpu
            refuses it ("JAX does not support per-request seed."); seed the
            engine instead, ``engine_kwargs={"seed": 0}`` (one generator per engine).
        tensor_parallel_size, pipeline_parallel_size: default: sized to the slice.
        engine_kwargs: more vLLM engine arguments (``max_model_len``, ``dtype``, ...).
        batch_size: rows per Ray Data batch sent to an engine.
        max_concurrent_batches: batches in flight per engine.
        runtime_env: of the engines (our variables are added to ``env_vars``).
        reserve_timeout_s: how long reserving a multi-host slice for an engine
            waits for a free slice head (Ray's ``head_reservation_timeout_s``),
            then fails with TimeoutError; default None: waits until one is free
            (the job starts only when the cluster has ``num_slices`` idle slices,
            so a wait means another job took one). A one-host slice's engine
            waits for its slice without a limit, logging every 30 s.
        simulate: the simulated TPU platform (vLLM's CPU kernels, gloo);
            default: ``RAY_TRAIN_TPU_SIMULATE=1`` in this process.
    """

    model: str
    topology: str
    accelerator_type: str
    num_slices: int = 1
    prompt_column: str = "prompt"
    max_tokens: int = 64
    temperature: float = 0.0
    sampling_params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    batch_size: int = 32
    max_concurrent_batches: int = 4
    runtime_env: Optional[Mapping[str, Any]] = None
    simulate: Optional[bool] = None
    reserve_timeout_s: Optional[float] = None
    engine_shape: Optional[str] = None
    engines_per_slice: Optional[int] = None

    def __post_init__(self):
        V.check_num_slices(_WHERE, self.num_slices)
        V.check_int(_WHERE, "max_tokens", self.max_tokens, min=1)
        V.check_number(_WHERE, "temperature", self.temperature, positive=False)
        V.check_int(_WHERE, "batch_size", self.batch_size, min=1)
        V.check_int(_WHERE, "max_concurrent_batches", self.max_concurrent_batches, min=1)
        if not isinstance(self.prompt_column, str) or not self.prompt_column:
            raise V.fail(_WHERE, "prompt_column", self.prompt_column, "a column name", error=TypeError)
        if self.reserve_timeout_s is not None:
            V.check_seconds(_WHERE, "reserve_timeout_s", self.reserve_timeout_s,
                            fix="e.g. reserve_timeout_s=600, or None to wait until a slice is free")
        if not isinstance(self.sampling_params, Mapping):
            raise V.fail(_WHERE, "sampling_params", self.sampling_params, "a dict of vllm.SamplingParams fields",
                         error=TypeError)
        if self.sampling_params.get("seed") is not None and self.temperature != 0:
            raise ValueError(
                f"{_WHERE}(sampling_params={{'seed': {self.sampling_params['seed']!r}}}) with temperature="
                f"{self.temperature}: vllm-torchtpu refuses a per-request seed for a sampled request "
                "(\"JAX does not support per-request seed.\"); seed the engine instead: "
                f"engine_kwargs={{'seed': {self.sampling_params['seed']!r}}}"
            )
        clash = {"max_tokens", "temperature"} & set(self.sampling_params)
        if clash:
            raise ValueError(f"{_WHERE}(sampling_params=...) sets {sorted(clash)}; give them as "
                             f"BatchConfig fields ({', '.join(f'{k}=' for k in sorted(clash))}) instead")
        engine = slice_engine(self.model, self.topology, self.accelerator_type,
                              tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              engine_kwargs=self.engine_kwargs, simulate=self.simulate,
                              engine_shape=self.engine_shape, chip_in_actor=True)
        pieces = engine.spec.shape.count if engine.on_piece else 1
        if self.engines_per_slice is not None:
            V.check_int(_WHERE, "engines_per_slice", self.engines_per_slice, min=1, max=pieces,
                        fix=f"at most {pieces} {self.engine_shape or self.topology} engine(s) fit one "
                            f"{self.topology} slice; give engine_shape for several")
        object.__setattr__(self, "engines_per_slice", self.engines_per_slice or pieces)
        context = engine.engine_kwargs.get("max_model_len") or model_context_length(self.model)
        if context is not None and self.max_tokens >= context:
            raise V.fail(_WHERE, "max_tokens", self.max_tokens,
                         f"below the model's context of {context} tokens (the prompt needs at least one)",
                         "lower max_tokens, or raise engine_kwargs max_model_len if the model allows it")
        object.__setattr__(self, "_engine", engine)

    @property
    def engine(self) -> SliceEngine:
        """The checked engine of every slice (TP x PP, engine arguments, environment)."""
        return self._engine

    @property
    def num_engines(self) -> int:
        return self.num_slices * self.engines_per_slice

    @property
    def sampling(self) -> dict:
        return {**self.sampling_params, "max_tokens": self.max_tokens, "temperature": float(self.temperature)}


class SliceBatchProcessor:
    """Ray Data LLM's vLLM processor with one engine per slice of `config`.

    Calling it on a dataset returns the (lazy) output dataset; the slices it
    reserves for its engines are released by `release` (or on leaving a
    ``with`` block). `run_batch` does both.
    """

    def __init__(self, config: BatchConfig):
        self.config = config
        self.job = f"rtt-batch-{uuid.uuid4().hex[:8]}"
        self._processor = None

    def __enter__(self) -> "SliceBatchProcessor":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # After a clean run the engines shut down first; after an error, at once.
        self.release(wait_s=ENGINE_EXIT_WAIT_S if exc_type is None else 0.0)

    def __call__(self, dataset: Any) -> Any:
        columns = _columns(dataset)
        if self.config.prompt_column not in columns:
            raise ValueError(
                f"the dataset has no column {self.config.prompt_column!r} (its columns: {columns}); "
                "set BatchConfig(prompt_column=...) to the column of prompt texts"
            )
        _check_cluster(self.config)
        if self._processor is None:
            self._processor = self._build(columns)
        return self._processor(dataset)

    def release(self, wait_s: float = 0.0) -> int:
        """Release every slice this processor reserved; returns how many. Waits
        up to `wait_s` seconds for the engines in them to exit first."""
        return release(self.job, wait_s=wait_s)

    def _build(self, columns: list) -> Any:
        import ray

        from ray_train_tpu._compat import ray_data as R

        cfg, engine = self.config, self.config.engine
        # vLLM's engine core runs in a child process of the engine actor and joins
        # the cluster itself: this one, not whichever "auto" finds on the host.
        env = {**engine.env, C.RAY_ADDRESS: ray.get_runtime_context().gcs_address}
        # The driver only describes the engines: vLLM is imported where they run
        # (`_compat.ray_data.vllm_left_to_engines`), not here first.
        with R.vllm_left_to_engines():
            from ray_train_tpu.serve import _batch_engine

            processor_config = R.vLLMEngineProcessorConfig(
                model_source=cfg.model,
                engine_kwargs=engine.engine_kwargs,
                runtime_env=with_env(cfg.runtime_env, env),
                concurrency=(cfg.num_engines, cfg.num_engines),
                batch_size=cfg.batch_size,
                max_concurrent_batches=cfg.max_concurrent_batches,
                chat_template_stage=False, tokenize_stage=False, detokenize_stage=False,
                log_engine_metrics=False,
            )
            prompt, sampling = cfg.prompt_column, cfg.sampling
            processor = R.build_processor(
                processor_config,
                preprocess=lambda row: {"prompt": row[prompt], "sampling_params": sampling},
                postprocess=functools.partial(_output_row, columns),
            )
            R.place_engines(
                processor, _batch_engine.SliceEngineUDF,
                functools.partial(engine_remote_args, self.job, engine, timeout_s=cfg.reserve_timeout_s),
                slice_topology=engine.spec.engine.name if engine.on_piece else engine.spec.topology,
                slice_accelerator_type=engine.spec.accelerator_type, slice_column=SLICE_COLUMN,
                sub_slice=engine.on_piece, chip_in_actor=engine.chip_in_actor,
            )
        return processor


def build_batch_processor(config: BatchConfig) -> SliceBatchProcessor:
    """A processor for `config` (see `SliceBatchProcessor`)."""
    return SliceBatchProcessor(config)


def run_batch(config: BatchConfig, dataset: Any) -> Any:
    """Run `dataset` through `config`'s engines to the end and release their
    slices; returns the materialized output dataset."""
    with SliceBatchProcessor(config) as processor:
        return processor(dataset).materialize()


# Reservations, in the driver: `engine_remote_args` is the engine stage's
# ``ray_remote_args_fn``; Ray Data calls it for every engine actor it starts,
# and the actor runs in the placement group it returns (Ray's
# ``SlicePlacementGroup``: one ``{"TPU": 1}`` bundle per device, gang-scheduled
# on one slice; child tasks captured, so that vLLM's Ray executor finds it).
# batch job id -> its SlicePlacementGroup handles.
_RESERVATIONS: dict[str, list] = {}
_LOCK = threading.Lock()


def engine_remote_args(job: str, engine: SliceEngine, timeout_s: Optional[float] = None) -> dict:
    """The engine stage's ``ray_remote_args_fn``: `reserve_engine` when Ray Data
    starts an engine actor; nothing for its other calls (its high-memory issue
    detector calls the function at the start of every execution and now and
    then after, which would otherwise reserve a slice each time that no engine
    ever runs on, or block the executor waiting for one:
    `_compat.ray_data.starting_an_actor`)."""
    from ray_train_tpu._compat.ray_data import starting_an_actor

    if not starting_an_actor():
        return {}
    return reserve_engine(job, engine, timeout_s=timeout_s)


def reserve_engine(job: str, engine: SliceEngine, timeout_s: Optional[float] = None) -> dict:
    """Reserve what one engine actor of `engine` runs on (a whole slice, or its
    ``engine_shape`` piece of one) and return the actor's remote arguments: the
    placement group's scheduling strategy and, for an engine that holds its one
    chip itself (`SliceEngine.chip_in_actor`), that chip."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = engine.spec
    if engine.on_piece:
        handle = _reserve_piece(job, spec, engine.simulated, timeout_s)
        pg = handle.placement_group
    else:
        strategy = reserve_slice(job, spec.topology, spec.accelerator_type, engine.strategy, timeout_s=timeout_s)
        pg = strategy["scheduling_strategy"].placement_group
    if not engine.chip_in_actor:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)}
    return {"resources": {"TPU": 1},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}


class _Piece:
    """A sub-slice engine's placement group, released as a slice's is."""

    def __init__(self, pg):
        self.placement_group = pg

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.placement_group)


def _reserve_piece(job: str, spec, simulated: bool, timeout_s: Optional[float]) -> _Piece:
    from ray_train_tpu.serve.pieces import reserve_engine_slice

    with _LOCK:
        handles = _RESERVATIONS.setdefault(job, [])
        try:
            pg = reserve_engine_slice(spec, name=f"{job}-engine-{len(handles)}", simulated=simulated,
                                      timeout_s=timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"no free {spec.engine_shape} piece of a {spec.accelerator_type} {spec.topology} slice within "
                f"BatchConfig(reserve_timeout_s={timeout_s}) for engine {len(handles)} of batch job {job} (another "
                "job holds the chips); raise reserve_timeout_s, or None to wait until one is free"
            ) from e
        handle = _Piece(pg)
        handles.append(handle)
    return handle


def reserve_slice(job: str, topology: str, accelerator_type: str, strategy: str,
                  timeout_s: Optional[float] = None) -> dict:
    """Reserve one whole free slice for an engine actor; returns the actor's
    scheduling strategy.

    A multi-host slice is reserved by its head (Ray's ``reserve_tpu_slice``):
    this call blocks until a free slice head is reserved, at most `timeout_s`
    seconds (None: no limit), then raises TimeoutError. A one-host slice has
    no head: the call returns at once and the engine actor waits for its
    placement group (`_layout.wait_for_slice`, logging every 30 s)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from ray.util.tpu import SlicePlacementGroup

    with _LOCK:
        handles = _RESERVATIONS.setdefault(job, [])
        try:
            handle = SlicePlacementGroup(topology=topology, accelerator_version=accelerator_type,
                                         resources_per_bundle={"TPU": 1}, strategy=strategy,
                                         name=f"{job}-engine-{len(handles)}", head_reservation_timeout_s=timeout_s)
        except TimeoutError as e:
            raise TimeoutError(
                f"no {accelerator_type} {topology} slice head became free within BatchConfig(reserve_timeout_s="
                f"{timeout_s}) for engine {len(handles)} of batch job {job} (another job holds the slices); "
                "raise reserve_timeout_s, or None to wait until one is free"
            ) from e
        handles.append(handle)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        handle.placement_group, placement_group_capture_child_tasks=True)}


def reservations(job: str) -> int:
    with _LOCK:
        return len(_RESERVATIONS.get(job, []))


def release(job: str, wait_s: float = 0.0) -> int:
    """Release every slice reserved for `job` (its engines die with them), once
    no actor runs in them any more or `wait_s` seconds have passed."""
    with _LOCK:
        handles = _RESERVATIONS.pop(job, [])
    if handles and wait_s > 0:
        _wait_until_empty([h.placement_group for h in handles], wait_s)
    for handle in handles:
        handle.shutdown()
    return len(handles)


def _wait_until_empty(pgs: list, wait_s: float) -> None:
    """Until no actor of the cluster runs in `pgs` (Ray's state API), at most `wait_s` s."""
    from ray.util.state import list_actors

    ids = {pg.id.hex() for pg in pgs}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000, detail=True,
                                            raise_on_missing_output=False)
                     if a.placement_group_id in ids]
        except Exception as e:  # noqa: BLE001 - no state API (no dashboard): release at once
            logger.debug("cannot list the engines' actors (%s); releasing their slices now", e)
            return
        if not alive:
            return
        if time.monotonic() > deadline:
            logger.warning("%d engine actor(s) still run %.0f s after the last row; releasing their slices anyway",
                           len(alive), wait_s)
            return
        time.sleep(0.5)


def _output_row(columns: list, row: dict) -> dict:
    out = {c: row[c] for c in columns}
    out.update(
        generated_text=row["generated_text"],
        generated_token_ids=[int(t) for t in row["generated_tokens"]],
        num_input_tokens=int(row["num_input_tokens"]),
        num_generated_tokens=int(row["num_generated_tokens"]),
    )
    out[SLICE_COLUMN] = row[SLICE_COLUMN]
    return out


def _columns(dataset: Any) -> list:
    schema = dataset.schema()
    if schema is None:
        raise ValueError("the dataset has no rows (its schema is unknown); give it at least one prompt")
    return list(schema.names)


def _check_cluster(config: BatchConfig) -> None:
    """Refuse, before anything is reserved, a job the cluster has too few idle
    slices for (intact and with every chip free: Ray's ``get_num_ready_tpu_slices``;
    engines on pieces of slices need ``num_slices`` idle slices too)."""
    import ray
    from ray.util.tpu import get_num_ready_tpu_slices, get_num_tpu_slices

    if not ray.is_initialized():
        ray.init()
    spec = config.engine.spec
    idle = get_num_ready_tpu_slices(spec.topology, spec.accelerator_type)
    intact = get_num_tpu_slices(spec.topology, spec.accelerator_type) if idle < config.num_slices else idle
    deadline = time.monotonic() + IDLE_SETTLE_S
    # Chips of a slice released a moment ago reach Ray's resource view a
    # heartbeat later: give slices that exist a few seconds to show as idle.
    while idle < config.num_slices <= intact and time.monotonic() < deadline:
        time.sleep(0.5)
        idle = get_num_ready_tpu_slices(spec.topology, spec.accelerator_type)
    if idle < config.num_slices:
        raise ValueError(
            f"BatchConfig(num_slices={config.num_slices}) needs {config.num_slices} idle {spec.accelerator_type} "
            f"{spec.topology} slices, but the Ray cluster has {idle} idle (of {intact} intact; the others run "
            "something else); lower num_slices, add slices, or wait for the running jobs to end"
        )
