"""Serving replicas on sub-slices: what each replica owns when several fill one
slice. Pure validation and choice, no Ray, no vLLM.

A replica of ``build_llm_config(..., engine_shape=...)`` runs one vLLM engine
on one ICI-connected piece of a slice, the layout planner's engine shape
(`layout_planner.engine_shapes`):

- whole hosts of a multi-host slice (``cut_by == "SubslicePlacementGroup"``):
  Ray's ``SubslicePlacementGroup`` picks free hosts that form the shape, from
  the chips' coordinates;
- part of one host (1 or 2 chips of a 4-chip host, up to 4 of an 8-chip one):
  no Ray primitive cuts less than a host, so the replica takes the chips on
  the busiest host that still has room (`pick_host`: best fit, which keeps
  whole hosts free for the sub-slices that need them).

Either way the replica's placement group has one ``{"TPU": 1}`` bundle per
device (vLLM's Ray executor puts one worker in each), it is created by the
replica when it starts and dies with it: autoscaling adds and releases one
sub-slice at a time. The engine sees its piece as a slice of its own
(`slice_plan.engine_topology`).

Example:
    >>> from ray_train_tpu.serve.spec import ModelShape
    >>> tiny = ModelShape(num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=2)
    >>> s = SubsliceServeSpec(accelerator_type="v4", topology="2x2x2", engine_shape="1x1x1", model=tiny)
    >>> s.tensor_parallel_size, s.shape.cut_by, s.shape.count
    (1, 'part of one host', 8)
    >>> SubsliceServeSpec(accelerator_type="v4", topology="2x2x2", engine_shape="2x2x1").shape.cut_by
    'SubslicePlacementGroup'
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from ray_train_tpu.serve.layout_planner import EngineShape, engine_shapes
from ray_train_tpu.serve.slice_plan import engine_topology
from ray_train_tpu.serve.spec import ModelShape, SliceServeSpec, size_parallelism
from ray_train_tpu.topology import Topology


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubsliceServeSpec:
    """One replica's sub-slice of a `topology` slice, and how the model is
    spread over it, checked before anything starts.

    Args:
        accelerator_type, topology: the slices the replicas fill.
        engine_shape: each replica's piece, e.g. ``"1x1x1"`` (one v4 chip),
            ``"2x2x1"`` (one v4 host), ``"2x4"`` (two v6e hosts); one of
            `layout_planner.engine_shapes` (``serve --plan`` prints the one
            that fits the model). The slice's own topology means one engine
            per whole slice.
        tensor_parallel_size, pipeline_parallel_size: default (None): sized so
            that TP x PP is the piece's device count, TP as large as the model
            allows.
        model: the model's shape (heads, layers; footprint when known).
    """

    accelerator_type: str
    topology: str
    engine_shape: str
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    model: Optional[ModelShape] = None

    def __post_init__(self):
        # The slice itself: generation and topology checked as for a whole-slice replica.
        whole = SliceServeSpec(accelerator_type=self.accelerator_type, topology=self.topology)
        object.__setattr__(self, "accelerator_type", whole.accelerator_type)
        object.__setattr__(self, "topology", whole.topology)
        shapes = engine_shapes(whole.parsed)
        valid = [s for s in shapes if _engine_topology_or_none(s.name, whole.accelerator_type)]
        name = self.engine_shape.strip().lower() if isinstance(self.engine_shape, str) else self.engine_shape
        shape = next((s for s in valid if s.name == name), None)
        if shape is None:
            raise ValueError(
                f"engine_shape {self.engine_shape!r} is no piece that one {whole.parsed} can be cut into "
                "(rule: part of one host, or whole hosts that Ray's SubslicePlacementGroup cuts, or the whole "
                f"slice); valid: {', '.join(f'{s.name} ({s.devices} devices, {s.cut_by})' for s in valid)}; "
                f"python -m ray_train_tpu serve --model <model> --topology {whole.topology} "
                f"--accelerator-type {whole.accelerator_type} --plan prints the one the model needs"
            )
        object.__setattr__(self, "engine_shape", shape.name)
        tp, pp = size_parallelism(shape.devices, self.model, self.tensor_parallel_size, self.pipeline_parallel_size,
                                  where=f"one {shape.name} engine_shape")
        object.__setattr__(self, "tensor_parallel_size", tp)
        object.__setattr__(self, "pipeline_parallel_size", pp)
        footprint = self.model and self.model.footprint
        why = footprint and footprint.memory_problem(whole.parsed.generation, tp, pp)
        if why:
            raise ValueError(
                f"{self.model.source} does not fit engine_shape {shape.name} as tensor_parallel_size {tp} x "
                f"pipeline_parallel_size {pp}: {why} (rule: weights + one full-context sequence of KV cache "
                "within 90% of each device's HBM); use a larger engine_shape (serve --plan prints the smallest)"
            )

    @property
    def parent(self) -> Topology:
        return Topology.parse(self.topology, self.accelerator_type)

    @property
    def shape(self) -> EngineShape:
        return next(s for s in engine_shapes(self.parent) if s.name == self.engine_shape)

    @property
    def engine(self) -> Topology:
        """The engine's own slice (`slice_plan.engine_topology`)."""
        return engine_topology(self.engine_shape, self.accelerator_type)

    @property
    def whole_slice(self) -> bool:
        return self.shape.cut_by == "whole slice"

    @property
    def part_of_host(self) -> bool:
        return self.shape.cut_by == "part of one host"


def _engine_topology_or_none(name: str, accelerator_type: str) -> Optional[Topology]:
    try:
        return engine_topology(name, accelerator_type)
    except ValueError:
        return None  # e.g. one TensorCore of a v7x chip: no engine shape Ray can give a process


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostRoom:
    """A TPU host and its free chips, as Ray's node table tells them."""

    node_id: str
    slice_name: str
    worker_id: int
    accelerator_type: str
    free: float  # available TPU
    total: float  # the host's TPU


def pick_host(hosts: Sequence[HostRoom], devices: int, accelerator_type: str) -> Optional[HostRoom]:
    """The host an engine on part of one host takes `devices` chips of: of the
    hosts of `accelerator_type` with room, the one with the fewest free chips
    (best fit, so that whole hosts stay free for engines of whole hosts), then
    by slice name and worker id. None when no host has room.

    Example:
        >>> h = lambda w, free: HostRoom(node_id=f"n{w}", slice_name="s", worker_id=w,
        ...                             accelerator_type="TPU-V4", free=free, total=4)
        >>> pick_host([h(0, 4), h(1, 2), h(2, 1)], 2, "TPU-V4").worker_id
        1
        >>> pick_host([h(0, 1)], 2, "TPU-V4") is None
        True
    """
    fits = [h for h in hosts if h.accelerator_type == accelerator_type and h.free >= devices]
    return min(fits, key=lambda h: (h.free, h.slice_name, h.worker_id), default=None)


def host_rooms(nodes: Sequence[Mapping], available: Mapping[str, Mapping[str, float]], *,
               slice_name_key: str, worker_id_key: str, accelerator_key: str) -> list[HostRoom]:
    """`HostRoom` of every alive TPU host in Ray's node table (``ray.nodes()``)
    and available resources per node."""
    out = []
    for n in nodes:
        labels = n.get("Labels") or {}
        total = (n.get("Resources") or {}).get("TPU", 0)
        if not n.get("Alive") or not total or labels.get(slice_name_key) is None or labels.get(worker_id_key) is None:
            continue
        out.append(HostRoom(node_id=n["NodeID"], slice_name=labels[slice_name_key],
                            worker_id=int(labels[worker_id_key]), accelerator_type=labels.get(accelerator_key, ""),
                            free=available.get(n["NodeID"], {}).get("TPU", 0), total=total))
    return out
