"""Per-step throughput: step time, samples/s, tokens/s and model FLOPs utilisation.

MFU = achieved model FLOP/s / peak FLOP/s of the devices. Peak dense bf16 FLOP/s
per chip come from `ray_train_tpu.topology.GENERATIONS` (sources:
cloud.google.com/tpu/docs/v4, /v5p, /v5e, /v6e, /tpu7x; the same figures as
torch_tpu's ``hardware._BF16_FLOPS_PER_CHIP``); on v7x a device is half a chip.
On a simulated slice (CPU) there is no meaningful peak: MFU is None and every
result says ``simulated: True``.

Example:
    >>> meter = ThroughputMeter(flops_per_sample=6 * n_params * seq_len, tokens_per_sample=seq_len)  # doctest: +SKIP
    >>> for batch in loader:                                      # doctest: +SKIP
    ...     train_step(batch)
    ...     ray.train.report(meter.step(len(batch)))
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ray_train_tpu import _environ
from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.device import is_simulated


def peak_flops_per_device(accelerator_type: Optional[str]) -> Optional[float]:
    """Peak dense bf16 FLOP/s of one device of `accelerator_type` (``"TPU-V6E"``
    or a pod type such as ``"v6e-16"``), or None when unknown."""
    from ray_train_tpu.topology import generation_of

    if not accelerator_type:
        return None
    try:
        return generation_of(accelerator_type).peak_bf16_flops_per_device
    except (TypeError, ValueError):
        return None


class ThroughputMeter:
    """Times steps and turns them into the metrics people expect.

    Args:
        flops_per_sample: model FLOPs per sample (forward + backward), e.g.
            ``6 * parameters * tokens`` for a transformer; enables MFU.
        tokens_per_sample: enables tokens/s.
        peak_flops_per_device: overrides the generation's peak (e.g. for GPUs).
        world_size: devices in the job; default ``WORLD_SIZE`` or 1.
    """

    def __init__(
        self,
        *,
        flops_per_sample: Optional[float] = None,
        tokens_per_sample: Optional[int] = None,
        peak_flops_per_device: Optional[float] = None,
        world_size: Optional[int] = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        for name, value in (("flops_per_sample", flops_per_sample), ("tokens_per_sample", tokens_per_sample),
                            ("peak_flops_per_device", peak_flops_per_device), ("world_size", world_size)):
            if value is not None:
                V.check_number("ThroughputMeter", name, value, fix=f"or {name}=None")
        self.simulated = is_simulated()
        self.flops_per_sample = flops_per_sample
        self.tokens_per_sample = tokens_per_sample
        self.world_size = world_size or int(_environ.get(C.WORLD_SIZE) or 1)
        if peak_flops_per_device is None and not self.simulated:
            peak_flops_per_device = peak_flops_per_device_of_host()
        self.peak = peak_flops_per_device
        self._clock = clock
        self._last = clock()
        self.steps = 0

    def reset(self) -> None:
        """Restart the clock, e.g. after evaluation or a checkpoint."""
        self._last = self._clock()

    def step(self, num_samples: int) -> dict:
        """Metrics for the step that just ended; `num_samples` on this worker."""
        now = self._clock()
        dt, self._last = max(now - self._last, 1e-12), now
        self.steps += 1
        samples_per_s = num_samples * self.world_size / dt
        out = {"step_time_s": dt, "samples_per_s": samples_per_s, "simulated": self.simulated}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        out["mfu"] = None
        if self.flops_per_sample and self.peak and not self.simulated:
            out["mfu"] = self.flops_per_sample * samples_per_s / (self.peak * self.world_size)
        return out


def peak_flops_per_device_of_host() -> Optional[float]:
    """The peak of this host's TPU generation, from ``TPU_ACCELERATOR_TYPE``."""
    return peak_flops_per_device(_environ.get(C.TPU_ACCELERATOR_TYPE))
