"""ThroughputMeter: numbers from a fake clock, MFU only where a peak is known."""

import pytest

from ray_train_tpu.throughput import ThroughputMeter, peak_flops_per_device


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_metrics_from_a_fake_clock(monkeypatch):
    monkeypatch.delenv("RAY_TRAIN_TPU_SIMULATE", raising=False)
    clock = _Clock()
    meter = ThroughputMeter(flops_per_sample=1e12, tokens_per_sample=128, peak_flops_per_device=918e12,
                            world_size=16, clock=clock)
    clock.t += 0.5
    m = meter.step(8)
    assert m["step_time_s"] == pytest.approx(0.5)
    assert m["samples_per_s"] == pytest.approx(8 * 16 / 0.5)
    assert m["tokens_per_s"] == pytest.approx(8 * 16 / 0.5 * 128)
    assert m["mfu"] == pytest.approx(1e12 * 256 / (918e12 * 16))
    assert m["simulated"] is False


def test_simulated_has_no_mfu(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_TPU_SIMULATE", "1")
    clock = _Clock()
    meter = ThroughputMeter(flops_per_sample=1e9, peak_flops_per_device=1e12, world_size=2, clock=clock)
    clock.t += 1
    m = meter.step(4)
    assert m["mfu"] is None and m["simulated"] is True and m["samples_per_s"] == 8


def test_peak_table_per_generation():
    assert peak_flops_per_device("TPU-V6E") == 918e12
    assert peak_flops_per_device("v6e-16") == 918e12
    assert peak_flops_per_device("v7x-16") == 2307e12 / 2  # a v7x device is half a chip
    assert peak_flops_per_device("v4-8") == 275e12
    assert peak_flops_per_device(None) is None and peak_flops_per_device("h100") is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="flops_per_sample=-1"):
        ThroughputMeter(flops_per_sample=-1)
