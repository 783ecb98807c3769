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


# ------------------------------------------------------------------ elastic num_slices=(min, max)


def test_a_slice_range_is_rays_worker_range_on_its_elastic_policy():
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
    from ray.train.v2._internal.execution.scaling_policy.factory import create_scaling_policy

    sc = TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_slices=(1, 3))
    assert sc.num_workers == (8, 24) and (sc.min_workers, sc.max_workers) == (8, 24)
    assert sc.elastic and sc.elasticity_enabled and (sc.min_slices, sc.max_slices) == (1, 3)
    assert isinstance(create_scaling_policy(sc), ElasticScalingPolicy)
    # what Ray's policy needs to count only intact slices (its _get_strict_tpu_worker_count)
    assert sc.use_tpu and sc.topology == "2x2x2" and sc.accelerator_type == "TPU-V4"
    from ray.util.tpu import get_tpu_worker_resources

    workers_per_slice, _ = get_tpu_worker_resources(
        topology=sc.topology, accelerator_type=sc.accelerator_type,
        resources_per_worker=sc._resources_per_worker_not_none, num_slices=1)
    assert workers_per_slice == sc.workers_per_slice == 8
    import dataclasses

    assert dataclasses.replace(sc).num_workers == (8, 24)  # Ray copies configs: idempotent
    assert TPUScalingConfig(topology="4x4", accelerator_type="TPU-V6E", num_slices=[2, 2]).num_slices == (2, 2)


def test_the_elastic_policy_counts_intact_slices_of_this_config(monkeypatch):
    """Ray's own arithmetic on our config: resources for 3 slices, 2 intact -> 2 slices of workers."""
    import ray.util.tpu
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

    sc = TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_slices=(1, 3))
    policy = ElasticScalingPolicy.__new__(ElasticScalingPolicy)
    policy.scaling_config = sc
    hosts = {f"n{i}": {"TPU": 4.0, "CPU": 5.0, "accelerator_type:TPU-V4": 1.0} for i in range(6)}  # 3 slices of 2 hosts
    monkeypatch.setattr(ray.util.tpu, "get_num_tpu_slices", lambda **kw: 2)
    assert policy._count_possible_workers(hosts) == 16
    monkeypatch.setattr(ray.util.tpu, "get_num_tpu_slices", lambda **kw: 3)
    assert policy._count_possible_workers(hosts) == 24


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_slices=(0, 2)), r"num_slices=\(0, 2\)\) must be a range of whole slices \(min >= 1\)"),
        (dict(num_slices=(3, 2)), r"num_slices=\(3, 2\)\) must be a \(min, max\) range with min <= max.*\(2, 3\)"),
        (dict(num_slices=(1, 2), num_workers=16), r"num_workers=16\) is fixed but num_slices=\(1, 2\) is an elastic range; omit num_workers"),
        (dict(num_slices=(1, 2), num_workers=(16, 48)), r"contradicts .* implies \(16, 32\) workers"),
        (dict(num_slices=(1, 2, 3)), r"an integer or a \(min, max\) range"),
        (dict(num_slices=(1.0, 2)), r"an integer or a \(min, max\) range"),
        (dict(num_slices=(1, 1000)), r"num_slices\[1\]=1000"),
    ],
)
def test_bad_slice_ranges_are_refused_by_name(kwargs, match):
    args = dict(topology="4x4", accelerator_type="TPU-V6E") | kwargs
    with pytest.raises(ValueError, match=match):
        TPUScalingConfig(**args)
