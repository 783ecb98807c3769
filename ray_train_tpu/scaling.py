"""`TPUScalingConfig`: Ray Train's ScalingConfig, sized from a TPU slice topology."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Union

from ray.train import ScalingConfig

from ray_train_tpu import _environ
from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.topology import Topology

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TPUScalingConfig(ScalingConfig):
    """A `ray.train.ScalingConfig` for one worker per TPU device on whole slices.

    The topology fixes the worker count: one worker per chip
    (``resources_per_worker={"TPU": 1}``), ``num_chips * num_slices`` workers,
    and Ray reserves each slice atomically with its ``SlicePlacementGroup``.
    On TPU-V7X a worker is one of the chip's two TensorCores (see
    `ray_train_tpu.topology`), so there are ``2 * num_chips`` per slice.

    Elastic: ``num_slices=(min, max)`` becomes Ray's worker range
    ``num_workers=(min * per_slice, max * per_slice)``, so Ray Train's
    elastic policy runs each attempt on as many whole, intact slices as the
    cluster has (at least ``min``, at most ``max``; it counts intact slices
    with ``ray.util.tpu.get_num_tpu_slices``) and resizes a running job when
    slices come back (``elastic_resize_monitor_interval_s``). See docs/elastic.md.

    Args:
        topology: slice mesh in chips, e.g. ``"4x4"`` or ``"2x2x2"``.
        accelerator_type: ``"TPU-V4"``, ``"TPU-V5P"``, ``"TPU-V5LITEPOD"``,
            ``"TPU-V6E"`` or ``"TPU-V7X"``.
        num_slices: slices to train on, connected over DCN; or ``(min, max)``
            for an elastic job.
        num_workers: optional; if given it must equal what the topology implies
            (a ``(min, max)`` pair for an elastic job).
        resources_per_worker: optional; ``"TPU"`` must be 1. Other resources
            (e.g. ``"CPU"``, ``"memory"``) are passed to Ray unchanged.

    Example:
        >>> sc = TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E")
        >>> sc.num_workers, sc.resources_per_worker
        (16, {'TPU': 1})
        >>> elastic = TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E", num_slices=(2, 4))
        >>> elastic.num_workers, elastic.min_slices, elastic.max_slices
        ((32, 64), 2, 4)
    """

    num_workers: Optional[Union[int, tuple]] = None  # derived from the topology
    use_tpu: bool = True
    num_slices: Union[int, tuple] = 1

    def __post_init__(self):
        if self.topology is None or self.accelerator_type is None:
            raise ValueError(
                "TPUScalingConfig needs topology and accelerator_type, e.g. "
                "TPUScalingConfig(topology='4x4', accelerator_type='TPU-V6E'); "
                f"got topology={self.topology!r}, accelerator_type={self.accelerator_type!r}"
            )
        if self.use_tpu is not True:
            raise ValueError(
                f"TPUScalingConfig(use_tpu={self.use_tpu!r}) is always True; for CPU or "
                "GPU training use ray.train.ScalingConfig"
            )
        if self.use_gpu:
            raise ValueError(
                "TPUScalingConfig(use_gpu=True) contradicts use_tpu=True; use "
                "ray.train.ScalingConfig(use_gpu=True) for GPUs"
            )
        topo = Topology.parse(self.topology, self.accelerator_type)
        self.num_slices = V.check_num_slices_range("TPUScalingConfig", self.num_slices)
        V.check_job_size(topo, self.max_slices, where="TPUScalingConfig")
        if self.resources_per_worker is not None:
            V.check_resources("TPUScalingConfig", "resources_per_worker", self.resources_per_worker)
        # Ray's spellings, so that its placement and validation see the same slice.
        self.topology = topo.name
        self.accelerator_type = topo.accelerator_type
        self._check_resource_per_chip(topo)
        self.resources_per_worker = self._derive_resources()
        self.num_workers = self._derive_num_workers(topo)
        super().__post_init__()

    @property
    def tpu_topology(self) -> Topology:
        """The parsed slice `Topology`."""
        return Topology.parse(self.topology, self.accelerator_type)

    @property
    def workers_per_slice(self) -> int:
        return self.tpu_topology.num_devices

    @property
    def elastic(self) -> bool:
        """True for a ``num_slices=(min, max)`` job."""
        return isinstance(self.num_slices, tuple)

    @property
    def min_slices(self) -> int:
        return self.num_slices[0] if self.elastic else self.num_slices

    @property
    def max_slices(self) -> int:
        return self.num_slices[1] if self.elastic else self.num_slices

    def _derive_resources(self) -> dict:
        resources = dict(self.resources_per_worker or {})
        tpus = resources.setdefault("TPU", 1)
        if tpus != 1:
            raise ValueError(
                f"TPUScalingConfig(resources_per_worker={self.resources_per_worker!r}) asks "
                f"for {tpus} TPU per worker; ray_train_tpu runs one worker per TPU "
                "device (torch_tpu binds each process to one device), so 'TPU' must "
                "be 1. Remove 'TPU' from resources_per_worker or set it to 1."
            )
        return resources

    def _derive_num_workers(self, topo: Topology) -> Union[int, tuple]:
        per_slice = topo.num_devices
        implied = per_slice * self.num_slices if not self.elastic else (
            per_slice * self.min_slices, per_slice * self.max_slices)
        given = tuple(self.num_workers) if isinstance(self.num_workers, list) else self.num_workers
        if given is None or given == implied:
            return implied
        unit = "TensorCore" if topo.devices_per_chip > 1 else "chip"
        if self.elastic and not isinstance(given, tuple):
            raise ValueError(
                f"TPUScalingConfig(num_workers={given!r}) is fixed but num_slices={self.num_slices!r} is an "
                f"elastic range; omit num_workers: the job runs {implied[0]}..{implied[1]} workers (one per "
                f"{unit}, {per_slice} a slice of {topo.name!r}), on as many whole slices as are free"
            )
        raise ValueError(
            f"TPUScalingConfig(num_workers={given!r}) contradicts topology {topo.name!r} on "
            f"{topo.accelerator_type} x {self.num_slices!r} slice(s), which implies {implied!r} workers (one per "
            f"{unit}: {topo.num_hosts} hosts x {topo.devices_per_host}); omit num_workers or set it to "
            f"{implied!r}" + ("" if self.elastic else "; for an elastic job give num_slices=(min, max)")
        )

    @staticmethod
    def _check_resource_per_chip(topo: Topology) -> None:
        # Ray counts one TPU resource per chip unless told otherwise; a worker
        # per TensorCore on v7x needs it to count one per core.
        want = topo.devices_per_chip
        have = _environ.get(C.RAY_TPU_RESOURCE_PER_CHIP) or "1"
        if have != str(want):
            raise ValueError(
                f"TPUScalingConfig(accelerator_type={topo.accelerator_type!r}): "
                f"{topo.accelerator_type} exposes {want} TorchTPU device(s) per chip and "
                f"ray_train_tpu runs one worker per device, but "
                f"{C.RAY_TPU_RESOURCE_PER_CHIP}={have} in the driver; export "
                f"{C.RAY_TPU_RESOURCE_PER_CHIP}={want} on the driver and on every "
                "TPU node before starting Ray"
            )
