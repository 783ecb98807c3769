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

    Args:
        topology: slice mesh in chips, e.g. ``"4x4"`` or ``"2x2x2"``.
        accelerator_type: ``"TPU-V4"``, ``"TPU-V5P"``, ``"TPU-V5LITEPOD"``,
            ``"TPU-V6E"`` or ``"TPU-V7X"``.
        num_slices: slices to train on, connected over DCN.
        num_workers: optional; if given it must equal what the topology implies.
        resources_per_worker: optional; ``"TPU"`` must be 1. Other resources
            (e.g. ``"CPU"``, ``"memory"``) are passed to Ray unchanged.

    Example:
        >>> sc = TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E")
        >>> sc.num_workers, sc.resources_per_worker
        (16, {'TPU': 1})
    """

    num_workers: Optional[Union[int, tuple]] = None  # derived from the topology
    use_tpu: bool = True
    num_slices: int = 1

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
        V.check_num_slices("TPUScalingConfig", self.num_slices)
        V.check_job_size(topo, self.num_slices, where="TPUScalingConfig")
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

    def _derive_num_workers(self, topo: Topology) -> int:
        implied = topo.num_devices * self.num_slices
        unit = "TensorCore" if topo.devices_per_chip > 1 else "chip"
        if self.num_workers is not None and self.num_workers != implied:
            raise ValueError(
                f"TPUScalingConfig(num_workers={self.num_workers!r}) contradicts "
                f"topology {topo.name!r} on {topo.accelerator_type} x {self.num_slices} "
                f"slice(s), which implies {implied} workers (one per {unit}: "
                f"{topo.num_hosts} hosts x {topo.devices_per_host}); omit num_workers "
                f"or set it to {implied}"
            )
        return implied

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
