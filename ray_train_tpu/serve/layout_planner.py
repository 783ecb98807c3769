"""How to lay vLLM engines out on a TPU slice: pure arithmetic, no Ray, no vLLM.

From the model's config (parameters, dtype, heads, KV heads, layers, KV cache
bytes per token: `ModelFootprint`) and the generation's HBM per chip
(`ray_train_tpu.topology.GENERATIONS`), `plan_layout` picks

1. the smallest engine that holds the weights plus a stated KV budget (by
   default one full-context sequence, the least vLLM starts with), using
   tensor parallelism only: TP must divide the attention heads, and the KV heads
   must divide by TP or TP by them (vLLM's rules); the engine is an
   ICI-connected piece of the slice (`engine_shapes`): part of one host (1, 2
   or 4 devices, the chip counts Ray lets one process hold) or a sub-slice of
   whole hosts that Ray's ``SubslicePlacementGroup`` can cut from this slice;
2. pipeline parallelism only when no TP-only engine fits (heads that no
   fitting TP divides);
3. as many engines as the slice has room for.

Every choice can be given instead (``tensor_parallel_size``,
``pipeline_parallel_size``, ``engines_per_slice``, ``kv_cache_tokens``,
``memory_utilization``); a layout that cannot fit is refused at construction
with the numbers (field, value, rule, fix).

The memory model is an estimate, stated in `LayoutPlan.describe`: weights are
split evenly over TP x PP devices; each device keeps the KV heads of its TP rank
(at least one: vLLM replicates KV heads when TP exceeds them) for its PP
stage's layers; usable HBM is ``memory_utilization`` (vLLM's
``gpu_memory_utilization``, 0.9 by default) of the device's share of the chip.
Activations, compiled programs and padding (vLLM's TPU backend pads head_dim)
come out of the remaining 10 %.

Example (the README's model on the README's slice):
    >>> qwen = ModelFootprint.from_config({
    ...     "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
    ...     "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936,
    ...     "max_position_embeddings": 32768, "tie_word_embeddings": True,
    ...     "torch_dtype": "bfloat16", "model_type": "qwen2"}, source="Qwen2.5-0.5B")
    >>> plan = plan_layout(qwen, "4x4", "TPU-V6E")
    >>> (plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.engine_shape, plan.engines_per_slice)
    (1, 1, '1x1', 16)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from ray_train_tpu.serve.spec import ModelShape
from ray_train_tpu.topology import Generation, Topology, get_generation, valid_topologies

GiB = 2**30

# KV budget of a model whose config names no context length.
DEFAULT_KV_CACHE_TOKENS = 4096
# vLLM's default share of device memory an engine may use (``gpu_memory_utilization``).
DEFAULT_MEMORY_UTILIZATION = 0.9
# The devices one Ray process may hold on one host (Ray's ``TPU_VALID_CHIP_OPTIONS``,
# in TPU resource units: one per TorchTPU device here).
SUB_HOST_DEVICES = (1, 2, 4, 8)
# Chip bounds of a sub-host engine, as Ray sets ``TPU_CHIPS_PER_HOST_BOUNDS``
# for a one- and a two-chip process; four and eight chips are a 2x2 / 2x4 block.
_SUB_HOST_CHIP_BOUNDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}

# The sub-slice shapes Ray 2.60's ``subslice_placement_group`` accepts, per
# generation: the shapes of its sub-slice table
# (``ray._private.accelerators.tpu._VALID_TOPOLOGY_WORKER_DIMS_2D/_3D``) that its
# ``VALID_TPU_TOPOLOGY`` allows for the generation. test_layout_planner reads
# both from Ray. A slice outside them is never cut into sub-slices.
_RAY_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16")
_RAY_2D = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
RAY_SUBSLICE_SHAPES = {
    "v4": frozenset(_RAY_3D),
    "v5p": frozenset(_RAY_3D + ("8x16x16", "16x16x16", "16x16x24")),
    "v5litepod": frozenset(_RAY_2D),
    "v6e": frozenset(_RAY_2D),
    "v7x": frozenset(_RAY_3D + ("8x16x16",)),
}

DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


def _dtype_bytes(field: str, value: Any, source: str) -> int:
    key = str(getattr(value, "name", value)).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(
            f"{source}: {field} {value!r} is not a dtype the planner knows; valid: "
            f"{', '.join(sorted(DTYPE_BYTES))}; give dtype='bfloat16' (or the one the engine loads)"
        )
    return DTYPE_BYTES[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFootprint:
    """What a model needs in device memory: weights and KV cache per token.

    Build it from a Hugging Face ``config.json`` with `from_config`.
    """

    num_parameters: int
    dtype: str
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    head_dim: int
    max_context: Optional[int] = None  # max_position_embeddings
    kv_cache_dtype: Optional[str] = None  # default: dtype
    source: str = "model"

    def __post_init__(self):
        for field in ("num_parameters", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                      "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.source}: {field} = {value!r} must be an integer >= 1")
        _dtype_bytes("dtype", self.dtype, self.source)
        if self.kv_cache_dtype is not None:
            _dtype_bytes("kv_cache_dtype", self.kv_cache_dtype, self.source)

    @property
    def shape(self) -> ModelShape:
        """Heads and layers, with vLLM's TP/PP rules (`ModelShape.tp_problem`)."""
        return ModelShape(num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                          num_hidden_layers=self.num_hidden_layers, source=self.source)

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * _dtype_bytes("dtype", self.dtype, self.source)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, the whole model."""
        return self.kv_bytes_per_token_per_device(1, 1)

    def kv_bytes_per_token_per_device(self, tp: int, pp: int) -> int:
        """One device's share: its KV heads (at least one; vLLM replicates KV
        heads when TP exceeds them) of its pipeline stage's layers."""
        kv_bytes = _dtype_bytes("kv_cache_dtype", self.kv_cache_dtype or self.dtype, self.source)
        heads = max(1, self.num_key_value_heads // tp)
        layers = math.ceil(self.num_hidden_layers / pp)
        return 2 * layers * heads * self.head_dim * kv_bytes

    def memory_problem(self, generation: Generation, tp: int, pp: int, *, kv_cache_tokens: Optional[int] = None,
                       memory_utilization: float = DEFAULT_MEMORY_UTILIZATION) -> Optional[str]:
        """Why TP x PP devices of `generation` cannot hold the weights plus
        `kv_cache_tokens` of KV cache (default: one full-context sequence), or None."""
        usable = usable_bytes_per_device(generation, memory_utilization)
        return _memory_problem(self, tp, pp, kv_cache_tokens or self.max_context or DEFAULT_KV_CACHE_TOKENS, usable)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        source: str = "model",
        *,
        dtype: Optional[str] = None,
        num_parameters: Optional[int] = None,
        kv_cache_dtype: Optional[str] = None,
    ) -> "ModelFootprint":
        """From a Hugging Face ``config.json`` dict (a multimodal model's
        ``text_config``). `dtype` (vLLM's ``dtype`` engine argument; ``"auto"``
        = the config's) and `num_parameters` override what the config says.

        The parameter count is that of a decoder-only transformer with a gated
        MLP (Llama, Qwen2, Mistral, Gemma and their mixture-of-experts kin);
        for another architecture give `num_parameters`.
        """
        cfg = config.get("text_config") or config
        need = ("num_attention_heads", "num_hidden_layers", "hidden_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(
                f"{source}: config.json has no {', '.join(missing)}; the layout planner sizes engines from "
                "them (a decoder-only causal LM config has them all)"
            )
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        kv = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                           and heads else 0)
        if dtype in (None, "auto"):
            dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        context = cfg.get("max_position_embeddings")
        return cls(
            num_parameters=num_parameters if num_parameters is not None else _count_parameters(cfg, source),
            dtype=str(dtype), num_attention_heads=heads, num_key_value_heads=kv,
            num_hidden_layers=cfg["num_hidden_layers"], head_dim=head_dim,
            max_context=context if isinstance(context, int) and context > 0 else None,
            kv_cache_dtype=None if kv_cache_dtype in (None, "auto") else kv_cache_dtype, source=source,
        )


def _count_parameters(cfg: Mapping[str, Any], source: str) -> int:
    """Parameters of a decoder-only transformer with a gated MLP (as Hugging
    Face builds Llama, Qwen2, Mistral, Gemma, Mixtral, Qwen2-MoE)."""
    missing = [k for k in ("vocab_size", "intermediate_size") if not cfg.get(k)]
    if missing:
        raise ValueError(
            f"{source}: config.json has no {', '.join(missing)}, so its parameters cannot be counted; "
            "give num_parameters (e.g. --num-parameters 8.0e9)"
        )
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if cfg.get("attention_bias") or cfg.get("model_type") in ("qwen2", "qwen2_moe"):
        attn += heads * hd + 2 * kv * hd  # q, k, v biases
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if experts:
        expert_i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        mlp = experts * 3 * h * expert_i + h * experts  # experts + router
        shared = cfg.get("shared_expert_intermediate_size") or 0
        mlp += 3 * h * shared + (h if shared else 0)
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    per_layer = attn + mlp + 2 * h  # two norms
    embed = vocab * h
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    return layers * per_layer + embed + head + h  # + final norm


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """An ICI-connected piece of a slice that one engine can own."""

    devices: int  # TorchTPU devices (vLLM workers)
    name: str  # chip bounds, e.g. "1x1", "2x4", "2x2x2"
    hosts: int  # hosts it spans (1 for a part of one host)
    count: int  # how many the slice holds
    cut_by: str  # "whole slice", "part of one host", "SubslicePlacementGroup"


def engine_shapes(topo: Topology) -> list[EngineShape]:
    """The engine shapes `topo` can be cut into, smallest first.

    Part of one host: 1, 2, 4 or 8 devices (what Ray lets one process hold on a
    host), fewer than the host has and dividing them. Whole hosts: the slice
    topologies of the generation whose host grid divides the slice's on every
    axis (what Ray's ``SubslicePlacementGroup`` cuts: ``ray.util.tpu``
    ``_build_subslice_labels``). And the whole slice.
    """
    gen = topo.generation
    dph = topo.devices_per_host
    out = [
        EngineShape(devices=d, name=_sub_host_name(gen, d), hosts=1, count=topo.num_hosts * (dph // d),
                    cut_by="part of one host")
        for d in SUB_HOST_DEVICES if d < dph and dph % d == 0
    ]
    ray_shapes = RAY_SUBSLICE_SHAPES.get(gen.pod_prefix, frozenset())
    if topo.is_multi_host and topo.name in ray_shapes:
        grid = [b // h for b, h in zip(topo.bounds, topo.host_bounds)]
        for name in valid_topologies(gen.accelerator_type):
            sub = Topology.parse(name, gen.accelerator_type)
            if name == topo.name or name not in ray_shapes or sub.num_chips < topo.chips_per_host:
                continue
            if any(b % h for b, h in zip(sub.bounds, topo.host_bounds)):
                continue  # not made of whole hosts of this slice
            sub_grid = [b // h for b, h in zip(sub.bounds, topo.host_bounds)]
            # Sub-slices that tile the slice: Ray 2.60 numbers the sub-slices of
            # a shape that does not divide the slice's host grid inconsistently
            # (``_build_subslice_labels``: 8x8x16 in 16x16x24).
            if all(g % s == 0 for s, g in zip(sub_grid, grid)):
                out.append(EngineShape(devices=sub.num_devices, name=name, hosts=math.prod(sub_grid),
                                       count=math.prod(g // s for g, s in zip(grid, sub_grid)),
                                       cut_by="SubslicePlacementGroup"))
    out.append(EngineShape(devices=topo.num_devices, name=topo.name, hosts=topo.num_hosts, count=1,
                           cut_by="whole slice"))
    return out


def _sub_host_name(gen: Generation, devices: int) -> str:
    chips = devices / gen.devices_per_chip
    if chips < 1:
        dims = (1, 1, 1)[: gen.num_dims]
        return "x".join(map(str, dims)) + f" ({devices} of {gen.devices_per_chip} cores)"
    dims = _SUB_HOST_CHIP_BOUNDS[int(chips)][: gen.num_dims]
    return "x".join(map(str, dims))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """How engines fill one slice (`plan_layout` builds it)."""

    model: ModelFootprint
    topology: Topology
    tensor_parallel_size: int
    pipeline_parallel_size: int
    engine: EngineShape
    engines_per_slice: int
    kv_cache_tokens: int
    memory_utilization: float
    rejected: tuple[str, ...] = ()  # smaller layouts and why they do not fit

    @property
    def engine_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def engine_shape(self) -> str:
        return self.engine.name

    @property
    def whole_slice(self) -> bool:
        return self.engine.cut_by == "whole slice"

    @property
    def usable_bytes_per_device(self) -> int:
        return usable_bytes_per_device(self.topology.generation, self.memory_utilization)

    @property
    def weight_bytes_per_device(self) -> int:
        return math.ceil(self.model.weight_bytes / self.engine_devices)

    @property
    def kv_bytes_per_device(self) -> int:
        return self.kv_cache_tokens * self.model.kv_bytes_per_token_per_device(
            self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def kv_tokens_per_engine(self) -> int:
        """KV cache tokens each engine can hold in what is left after the weights."""
        per_token = self.model.kv_bytes_per_token_per_device(self.tensor_parallel_size, self.pipeline_parallel_size)
        return max(0, self.usable_bytes_per_device - self.weight_bytes_per_device) // per_token

    def describe(self) -> str:
        m, t = self.model, self.topology
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        lines = [
            f"model {m.source}: {m.num_parameters / 1e9:.2f}B parameters in {m.dtype} = {gib(m.weight_bytes)}; "
            f"{m.num_attention_heads} heads, {m.num_key_value_heads} KV heads, {m.num_hidden_layers} layers; "
            f"KV cache {m.kv_bytes_per_token / 2**10:.1f} KiB per token",
            f"slice {t}: {t.num_devices} device{'s' * (t.num_devices > 1)}, {gib(t.generation.hbm_bytes_per_chip // t.devices_per_chip)} HBM "
            f"each, {gib(self.usable_bytes_per_device)} usable at memory_utilization {self.memory_utilization}",
            f"engine: TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} on {self.engine.name} "
            f"({self.engine_devices} device{'s' * (self.engine_devices > 1)}, {self.engine.hosts} "
            f"host{'s' * (self.engine.hosts > 1)}; {self.engine.cut_by})",
            f"per device: weights {gib(self.weight_bytes_per_device)} + KV budget {gib(self.kv_bytes_per_device)} "
            f"({self.kv_cache_tokens} tokens) of {gib(self.usable_bytes_per_device)}; room for "
            f"{self.kv_tokens_per_engine} KV tokens per engine",
            f"engines per slice: {self.engines_per_slice} (room for {self.engine.count})",
        ]
        lines += [f"  not {r}" for r in self.rejected]
        return "\n".join(lines)


def usable_bytes_per_device(gen: Generation, memory_utilization: float) -> int:
    return int(gen.hbm_bytes_per_chip // gen.devices_per_chip * memory_utilization)


def plan_layout(
    model: ModelFootprint,
    topology: str,
    accelerator_type: str,
    *,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    engines_per_slice: Optional[int] = None,
    kv_cache_tokens: Optional[int] = None,
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
) -> LayoutPlan:
    """The layout of `model`'s engines on one slice (see the module doc).

    Raises:
        ValueError: a given choice breaks a rule, or nothing fits; the message
            names the field, the value, the rule and a fix.
    """
    topo = Topology.parse(topology, get_generation(accelerator_type).accelerator_type)
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size),
                        ("engines_per_slice", engines_per_slice), ("kv_cache_tokens", kv_cache_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} {value!r} must be an integer >= 1 (or left out to be planned)")
    if not isinstance(memory_utilization, (int, float)) or not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization {memory_utilization!r} must be in (0, 1] (vLLM's "
                         f"gpu_memory_utilization; default {DEFAULT_MEMORY_UTILIZATION})")
    if kv_cache_tokens is None:
        kv_cache_tokens = model.max_context or DEFAULT_KV_CACHE_TOKENS
    shapes = engine_shapes(topo)
    by_devices = {s.devices: s for s in shapes}
    if tensor_parallel_size and pipeline_parallel_size:
        n = tensor_parallel_size * pipeline_parallel_size
        if n not in by_devices:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} x pipeline_parallel_size {pipeline_parallel_size} "
                f"= {n} devices is no engine shape of one {topo} (rule: an engine owns part of one host or "
                f"a sub-slice Ray can cut); valid engine sizes: {_sizes(shapes)}"
            )
    usable = usable_bytes_per_device(topo.generation, memory_utilization)
    rejected: list[str] = []
    for pp_allowed in (False, True):
        for shape in shapes:
            for tp, pp in _factorizations(shape.devices, pp_allowed):
                if tensor_parallel_size not in (None, tp) or pipeline_parallel_size not in (None, pp):
                    continue
                why = model.shape.tp_problem(tp) or model.shape.pp_problem(pp) or _memory_problem(
                    model, tp, pp, kv_cache_tokens, usable)
                if why:
                    rejected.append(f"TP {tp} x PP {pp} on {shape.name}: {why}")
                    continue
                room = shape.count
                if engines_per_slice is not None and engines_per_slice > room:
                    raise ValueError(
                        f"engines_per_slice {engines_per_slice} is more than one {topo} holds of "
                        f"TP {tp} x PP {pp} engines on {shape.name} (rule: at most {room}); give at most "
                        f"{room}, or a smaller engine"
                    )
                return LayoutPlan(model=model, topology=topo, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  engine=shape, engines_per_slice=engines_per_slice or room,
                                  kv_cache_tokens=kv_cache_tokens, memory_utilization=float(memory_utilization),
                                  rejected=tuple(rejected))
    given = {k: v for k, v in (("tensor_parallel_size", tensor_parallel_size),
                               ("pipeline_parallel_size", pipeline_parallel_size)) if v}
    fix = ("leave tensor_parallel_size / pipeline_parallel_size out to have them planned" if given else
           f"use a larger slice or generation, a smaller kv_cache_tokens (now {kv_cache_tokens}), or a "
           "smaller dtype")
    # The largest TP-only layout's reason is the telling one (PP splits the same bytes).
    tp_only = [r for r in rejected if " x PP 1 on " in r]
    tried = (tp_only[-1] if tp_only else rejected[-1]) if rejected else "no engine size matches"
    if len(rejected) > 1:
        tried += f" (and {len(rejected) - 1} smaller or pipelined layouts)"
    raise ValueError(
        f"{model.source} ({model.num_parameters / 1e9:.2f}B parameters, {model.weight_bytes / GiB:.1f} GiB in "
        f"{model.dtype}) has no layout on one {topo}"
        + (f" with {', '.join(f'{k} {v}' for k, v in given.items())}" if given else "")
        + f" ({usable / GiB:.1f} GiB usable per device): {tried}; {fix}"
    )


def _factorizations(devices: int, pp_allowed: bool) -> list[tuple[int, int]]:
    if not pp_allowed:
        return [(devices, 1)]
    # Largest TP first: pipeline stages only as many as the heads force.
    return [(devices // pp, pp) for pp in range(2, devices + 1) if devices % pp == 0]


def _memory_problem(model: ModelFootprint, tp: int, pp: int, kv_tokens: int, usable: int) -> Optional[str]:
    weights = math.ceil(model.weight_bytes / (tp * pp))
    kv = kv_tokens * model.kv_bytes_per_token_per_device(tp, pp)
    if weights + kv <= usable:
        return None
    return (f"weights {weights / GiB:.2f} GiB + KV {kv / GiB:.2f} GiB ({kv_tokens} tokens) per device "
            f"> {usable / GiB:.2f} GiB usable")


def _sizes(shapes: list[EngineShape]) -> str:
    return ", ".join(f"{s.devices} ({s.name})" for s in shapes)


def plan_from_config(
    config: Mapping[str, Any],
    topology: str,
    accelerator_type: str,
    *,
    source: str = "model",
    engine_kwargs: Optional[Mapping[str, Any]] = None,
    num_parameters: Optional[int] = None,
    tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: Optional[int] = None,
    engines_per_slice: Optional[int] = None,
    kv_cache_tokens: Optional[int] = None,
) -> LayoutPlan:
    """`plan_layout` for a ``config.json`` dict and vLLM engine arguments:
    ``dtype``, ``kv_cache_dtype``, ``gpu_memory_utilization`` and
    ``max_model_len`` (the default KV budget: one sequence that long) are read
    from `engine_kwargs`, TP and PP too unless given."""
    kwargs = dict(engine_kwargs or {})
    footprint = ModelFootprint.from_config(config, source, dtype=kwargs.get("dtype"), num_parameters=num_parameters,
                                           kv_cache_dtype=kwargs.get("kv_cache_dtype"))
    return plan_layout(
        footprint, topology, accelerator_type,
        tensor_parallel_size=tensor_parallel_size or kwargs.get("tensor_parallel_size"),
        pipeline_parallel_size=pipeline_parallel_size or kwargs.get("pipeline_parallel_size"),
        engines_per_slice=engines_per_slice,
        kv_cache_tokens=kv_cache_tokens or kwargs.get("max_model_len"),
        memory_utilization=kwargs.get("gpu_memory_utilization", DEFAULT_MEMORY_UTILIZATION),
    )
