"""TPUTorchTrainer takes exactly what TorchTrainer takes, plus `strategy`."""

import inspect

import pytest
from ray.train.torch import TorchConfig, TorchTrainer

from ray_train_tpu import TPUScalingConfig, TPUTorchConfig, TPUTorchTrainer


def test_signature_is_torch_trainers_plus_strategy():
    ours = inspect.signature(TPUTorchTrainer.__init__).parameters
    theirs = inspect.signature(TorchTrainer.__init__).parameters
    for name, param in theirs.items():
        assert name in ours, name
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name
    assert set(ours) - set(theirs) == {"strategy"}
    assert ours["strategy"].default == "ddp"


def test_is_a_torch_trainer_with_a_tpu_torch_config():
    trainer = TPUTorchTrainer(lambda: None, scaling_config=TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"))
    assert isinstance(trainer, TorchTrainer)
    cfg = trainer.backend_config
    assert isinstance(cfg, TPUTorchConfig)
    assert (cfg.topology, cfg.accelerator_type, cfg.num_slices) == ("2x2x2", "TPU-V4", 1)
    assert cfg.backend == "auto" and cfg.strategy is trainer.strategy


def test_a_plain_torch_config_is_converted_with_a_warning(caplog):
    trainer = TPUTorchTrainer(lambda: None, torch_config=TorchConfig(timeout_s=77),
                              scaling_config=TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"))
    assert isinstance(trainer.backend_config, TPUTorchConfig) and trainer.backend_config.timeout_s == 77
    assert "replaced by TPUTorchConfig" in caplog.text


def test_user_config_object_is_not_mutated():
    cfg = TPUTorchConfig(rendezvous_timeout_s=5)
    TPUTorchTrainer(lambda: None, torch_config=cfg,
                    scaling_config=TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"), strategy="fsdp2")
    assert cfg.strategy is None


def test_unknown_strategy_fails_before_any_worker_starts():
    with pytest.raises(ValueError, match="ddp"):
        TPUTorchTrainer(lambda: None, scaling_config=TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4"),
                        strategy="zero3")


def test_bad_torch_config_type():
    with pytest.raises(TypeError, match="must be a TPUTorchConfig"):
        TPUTorchTrainer(lambda: None, torch_config={"backend": "gloo"})


def test_an_elastic_job_checks_the_strategy_at_every_slice_count():
    import dataclasses

    from ray_train_tpu.strategies import DDPStrategy

    seen = []

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Recording(DDPStrategy):
        def validate(self, topology, num_slices, world_size):
            seen.append((num_slices, world_size))
            return super().validate(topology, num_slices, world_size)

    sc = TPUScalingConfig(topology="2x2x2", accelerator_type="TPU-V4", num_slices=(2, 4))
    trainer = TPUTorchTrainer(lambda: None, scaling_config=sc, strategy=Recording())
    assert seen == [(2, 16), (3, 24), (4, 32)]
    assert trainer.backend_config.num_slices == (2, 4)


def test_a_plain_ray_worker_range_is_checked_at_every_slice_count_too():
    from ray.train import ScalingConfig

    from ray_train_tpu.trainer import _slice_of

    sc = ScalingConfig(num_workers=(8, 24), use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4",
                       resources_per_worker={"TPU": 1})
    topology, sizes = _slice_of(sc)
    assert topology.name == "2x2x2" and sizes == [(1, 8), (2, 16), (3, 24)]
    trainer = TPUTorchTrainer(lambda: None, scaling_config=sc)
    assert trainer.backend_config.num_slices is None  # each attempt counts the live slices
