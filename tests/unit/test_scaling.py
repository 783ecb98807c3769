"""TPUScalingConfig: sized from the topology, accepted wherever Ray takes a ScalingConfig."""

import pytest
import ray.train
from ray.train.torch import TorchTrainer

from ray_train_tpu import TPUScalingConfig


@pytest.mark.parametrize(
    "topology, accel, num_slices, workers",
    [("4x4", "TPU-V6E", 1, 16), ("2x2x2", "TPU-V4", 2, 16), ("2x4", "TPU-V5LITEPOD", 1, 8), ("16x16x16", "TPU-V4", 1, 4096)],
)
def test_worker_count_is_derived(topology, accel, num_slices, workers):
    sc = TPUScalingConfig(topology=topology, accelerator_type=accel, num_slices=num_slices)
    assert sc.num_workers == workers
    assert sc.resources_per_worker == {"TPU": 1}
    assert sc.use_tpu is True
    assert sc.total_resources["TPU"] == workers


def test_is_a_ray_scaling_config_and_trainer_accepts_it():
    sc = TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4")
    assert isinstance(sc, ray.train.ScalingConfig)
    trainer = TorchTrainer(lambda: None, scaling_config=sc)
    assert trainer.scaling_config is sc or trainer.scaling_config == sc


def test_spellings_are_normalised_to_rays():
    sc = TPUScalingConfig(topology="2,2,2", accelerator_type="v4")
    assert (sc.topology, sc.accelerator_type) == ("2x2x2", "TPU-V4")


def test_extra_resources_are_kept():
    sc = TPUScalingConfig(topology="2x2", accelerator_type="TPU-V6E", resources_per_worker={"CPU": 2})
    assert sc.resources_per_worker == {"CPU": 2, "TPU": 1}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_workers=8), r"num_workers=8\) contradicts topology '4x4'.*implies 16 workers.*set it to 16"),
        (dict(resources_per_worker={"TPU": 4}), r"'TPU' must be 1"),
        (dict(num_slices=0), r"num_slices=0"),
        (dict(topology="4x5"), r"topology '4x5' is not a TPU-V6E slice.*valid: 1x1, 2x2"),
        (dict(accelerator_type=None), r"needs topology and accelerator_type"),
        (dict(use_gpu=True), r"use_gpu=True"),
        (dict(num_workers=(8, 16)), r"contradicts"),
    ],
)
def test_contradictions_are_value_errors(kwargs, match):
    args = dict(topology="4x4", accelerator_type="TPU-V6E") | kwargs
    with pytest.raises(ValueError, match=match):
        TPUScalingConfig(**args)


def test_v7x_needs_ray_to_count_tensorcores(monkeypatch):
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    with pytest.raises(ValueError, match="RAY_TPU_RESOURCE_PER_CHIP=2"):
        TPUScalingConfig(topology="2x2x1", accelerator_type="TPU-V7X")
    monkeypatch.setenv("RAY_TPU_RESOURCE_PER_CHIP", "2")
    sc = TPUScalingConfig(topology="2x2x1", accelerator_type="TPU-V7X")
    assert sc.num_workers == 8
