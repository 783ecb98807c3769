"""`get_device()`: the torch device of this worker, the same way in every mode.

- explicit simulation (``RAY_TRAIN_TPU_SIMULATE=1``): ``cpu``;
- a worker holding a TPU: ``tpu``, after checking that torch_tpu registered it
  (an error naming what is missing otherwise, never a CPU fallback);
- anything else: what ``ray.train.torch.get_device()`` says (``cuda:N`` or ``cpu``).

`compute_dtype()`: the low-precision dtype to train in, bfloat16 wherever the
hardware computes it natively.
"""

from __future__ import annotations

from typing import Optional

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

# CPU feature flags (Linux /proc/cpuinfo) that mean bfloat16 arithmetic in hardware:
# x86 AVX512-BF16 and AMX-BF16, Arm's BF16 extension. Without them torch emulates
# bfloat16 matmuls on the CPU, several times slower than float32.
_NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def is_simulated() -> bool:
    """True in a process of an explicitly simulated TPU slice."""
    return _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"


def get_device():
    """The torch device for this worker.

    Example:
        >>> model = model.to(ray_train_tpu.get_device())  # doctest: +SKIP
    """
    import torch

    if is_simulated():
        return torch.device("cpu")
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_accelerator_ids().get("TPU"):
        from ray_train_tpu import _worker

        _worker.check_tpu_runtime()
        return torch.device("tpu")
    import ray.train.torch

    return ray.train.torch.get_device()


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> bool:
    """True if this CPU computes bfloat16 in hardware (flags read from /proc/cpuinfo).

    Example:
        >>> cpu_has_native_bf16("flags\t: fpu sse2 avx2 avx512f avx512_bf16")
        True
        >>> cpu_has_native_bf16("flags\t: fpu sse2 avx2 fma")
        False
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & _NATIVE_BF16_CPU_FLAGS)


def compute_dtype():
    """The dtype to compute in under mixed precision: ``torch.bfloat16`` where native.

    On TPUs (and anywhere outside explicit simulation) bfloat16. On a simulated slice
    the "chips" are this machine's CPU cores: bfloat16 only if the CPU has bfloat16
    instructions (`cpu_has_native_bf16`), else float32, because emulated bfloat16
    made a simulated fine-tuning run several times slower. Call it where the
    simulation is visible: in a worker, or on the driver inside
    ``simulated_tpu_cluster`` (which sets ``RAY_TRAIN_TPU_SIMULATE=1`` there too).

    Example:
        >>> mp = MixedPrecisionPolicy(param_dtype=compute_dtype(), reduce_dtype=torch.float32)  # doctest: +SKIP
    """
    import torch

    if is_simulated() and not cpu_has_native_bf16():
        return torch.float32
    return torch.bfloat16
