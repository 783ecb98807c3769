"""TPUTorchConfig: validation, backend choice, and which preset values win."""

import logging

import pytest
from ray.train.torch import TorchConfig

from ray_train_tpu import TPUTorchConfig
from ray_train_tpu._backend import _RANK_KEYS, _choose_backend, _ranges, _warn_env_changes
from ray_train_tpu.launch_env import reconcile
from ray_train_tpu.topology import generation_of_pod_type as _generation_of


def test_is_a_torch_config_with_auto_backend():
    cfg = TPUTorchConfig()
    assert isinstance(cfg, TorchConfig) and cfg.backend == "auto"
    assert TPUTorchConfig(backend=None).backend == "auto"  # Ray's TorchTrainer would set tpu_dist
    assert cfg.to_dict()["rendezvous_timeout_s"] == 120.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init_method="tcp"), "init_method='tcp'"),
        (dict(rendezvous_timeout_s=0), "rendezvous_timeout_s=0"),
        (dict(base_port=70000), "base_port=70000"),
        (dict(extra_env={"A": 1}), "extra_env"),
        (dict(topology="4x4"), "both topology and accelerator_type"),
        (dict(topology="4x5", accelerator_type="TPU-V6E"), "valid: 1x1"),
    ],
)
def test_bad_fields(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TPUTorchConfig(**kwargs)


def test_backend_choice():
    """A simulated slice runs the same tpu_dist as a real one (gloo underneath, for
    device tensors only); an explicit gloo is the user's host-only group."""
    for mode in ("tpu", "simulate"):
        assert _choose_backend("auto", mode) == _choose_backend(None, mode) == "tpu_dist"
        assert _choose_backend("tpu_dist", mode) == "tpu_dist"
        assert _choose_backend("gloo", mode) == "gloo"
    with pytest.raises(ValueError, match="cannot run on a simulated slice"):
        _choose_backend("nccl", "simulate")


def test_host_values_are_replaced_overrides_kept_and_stale_job_variables_removed(caplog):
    computed = {"RANK": "3", "LOCAL_RANK": "3", "MASTER_PORT": "29500", "TORCH_TPU_BASE_PORT": "x",
                "TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"}
    preset = {"RANK": "7", "MASTER_PORT": "1234", "TPU_WORKER_HOSTNAMES": "host-a,host-b",
              "MEGASCALE_COORDINATOR_ADDRESS": "gone:8081"}
    extra = {"LOCAL_RANK": "9", "MY_FLAG": "1", "TORCH_TPU_BASE_PORT": "9000"}
    plan = reconcile(computed, preset, extra, fixed=_RANK_KEYS)
    with caplog.at_level(logging.WARNING):
        _warn_env_changes([plan, plan], extra)
    env = plan.env
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "3"  # Ray fixes ranks
    assert env["MASTER_PORT"] == "29500" and env["TPU_WORKER_HOSTNAMES"] == "10.0.0.1,10.0.0.2"
    assert env["MY_FLAG"] == "1" and env["TORCH_TPU_BASE_PORT"] == "9000"
    assert plan.unset == ("MEGASCALE_COORDINATOR_ADDRESS",)
    text = caplog.text
    assert "replacing MASTER_PORT='1234'" in text and "with '29500'" in text
    assert text.count("replacing MASTER_PORT") == 1  # once per variable, not per worker
    assert "removing MEGASCALE_COORDINATOR_ADDRESS" in text
    assert "extra_env) sets TORCH_TPU_BASE_PORT='9000'" in text
    assert "ignoring TPUTorchConfig(extra_env) LOCAL_RANK" in text


def test_small_helpers():
    assert _generation_of("v4-16") == "TPU-V4" and _generation_of("tpu7x-8") == "TPU-V7X"
    assert _generation_of("v5litepod-16") == "TPU-V5LITEPOD" and _generation_of(None) is None
    assert _ranges([4, 5, 6, 7, 9, 0]) == "0, 4-7, 9"


def test_shutdown_does_not_queue_behind_workers_stuck_in_a_timed_out_rendezvous(monkeypatch):
    """A stalled host's workers are still busy in the roll call: asking them to
    leave the process group would wait out the 30 s shutdown timeout."""
    from ray_train_tpu import _backend as config

    class Group:
        def __init__(self):
            self.called = []

        def __len__(self):
            return 4

        def execute_single_async(self, rank, fn):
            self.called.append((rank, fn.__name__))
            return rank

    waited = []
    monkeypatch.setattr(config.ray, "get", lambda futures, timeout: waited.append((futures, timeout)))
    backend = config._TPUTorchBackend()
    group = Group()
    backend.on_shutdown(group, None)
    assert group.called == [(r, "leave_process_group") for r in range(4)]
    backend._busy_ranks, group.called, waited[:] = frozenset({2, 3}), [], []
    backend.on_shutdown(group, None)
    assert group.called == [(0, "leave_process_group"), (1, "leave_process_group")]
    assert waited == [([0, 1], 30)]


def test_elastic_slice_ranges_and_hang_timeout():
    from ray_train_tpu._backend import _check_num_slices

    cfg = TPUTorchConfig(num_slices=[2, 3], hang_timeout_s=30)
    assert cfg.num_slices == (2, 3) and cfg.to_dict()["hang_timeout_s"] == 30
    assert TPUTorchConfig().hang_timeout_s == 600 and TPUTorchConfig(hang_timeout_s=None).hang_timeout_s is None
    for wanted, live in (((2, 3), 2), ((2, 3), 3), (None, 5), (4, 4)):
        _check_num_slices(wanted, live)
    with pytest.raises(ValueError, match=r"num_slices=\(2, 3\)\) but the workers span 1 slice"):
        _check_num_slices((2, 3), 1)
    with pytest.raises(ValueError, match=r"hang_timeout_s=0\) must be a finite number of seconds.*or None"):
        TPUTorchConfig(hang_timeout_s=0)
    with pytest.raises(ValueError, match=r"num_slices=\(3, 1\)"):
        TPUTorchConfig(num_slices=(3, 1))
