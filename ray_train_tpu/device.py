"""`get_device()`: the torch device of this worker, the same way in every mode.

- a worker holding a TPU: ``tpu``, after checking that torch_tpu registered it
  (an error naming what is missing otherwise, never a CPU fallback);
- the same worker on an explicitly simulated slice (``RAY_TRAIN_TPU_SIMULATE=1``):
  the simulated ``tpu`` device (`ray_train_tpu._compat.simulated_tpu`), which is
  not the host: a host tensor meeting a device tensor fails as on a TPU, so
  a batch that was never moved to the device fails here too. A process of a
  simulated host outside Ray (e.g. `ray_train_tpu.testing.gloo` ranks) gets it too;
- anything else: what ``ray.train.torch.get_device()`` says (``cuda:N`` or
  ``cpu``), also on the driver of a simulated cluster, which holds no TPU.

`accelerator_memory()`: this chip's memory in use, peak and total, from ``torch.accelerator``.

`compute_dtype()`: the low-precision dtype to train in, bfloat16 wherever the
hardware computes it natively.
"""

from __future__ import annotations

import functools
from typing import Optional

from ray_train_tpu import _environ, _host
from ray_train_tpu import constants as C

# CPU feature flags (Linux /proc/cpuinfo) that mean bfloat16 arithmetic in hardware:
# x86 AVX512-BF16 and AMX-BF16, Arm's BF16 extension. Without them torch emulates
# bfloat16 matmuls on the CPU, several times slower than float32.
_NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def is_simulated() -> bool:
    """True in a process of an explicitly simulated TPU slice."""
    return _environ.get(C.RAY_TRAIN_TPU_SIMULATE) == "1"


def simulated_device_kind() -> str:
    """``"tpu"`` (the simulated device, the default) or ``"host"`` (the CPU itself,
    only for overhead comparisons with CPU baselines), from
    ``RAY_TRAIN_TPU_SIMULATE_DEVICE``."""
    kind = _environ.get(C.RAY_TRAIN_TPU_SIMULATE_DEVICE) or "tpu"
    if kind not in C.SIMULATED_DEVICE_KINDS:
        raise ValueError(
            f"{C.RAY_TRAIN_TPU_SIMULATE_DEVICE}={kind!r} must be one of {', '.join(C.SIMULATED_DEVICE_KINDS)}; "
            "leave it unset for the simulated 'tpu' device"
        )
    return kind


# The "tpu" device once `check_tpu_runtime` passed in this process: torch_tpu's
# registrations last as long as the process, so the check runs once, not at every
# call (a training loop may call get_device() every step, as Ray's examples do).
_checked_tpu_device = None


def get_device():
    """The torch device for this worker.

    Cheap enough to call every step: the TPU runtime is checked at the first call
    in a process, and the worker's TPU assignment is a dictionary look-up.

    Example:
        >>> model = model.to(ray_train_tpu.get_device())  # doctest: +SKIP
    """
    global _checked_tpu_device
    import ray

    in_ray = ray.is_initialized()
    holds_tpu = in_ray and bool(ray.get_runtime_context().get_accelerator_ids().get("TPU"))
    if is_simulated() and (holds_tpu or not in_ray):
        from ray_train_tpu._compat import simulated_tpu

        if simulated_device_kind() == "host":
            return simulated_tpu.install_host_stand_in()
        device = simulated_tpu.install()  # idempotent: a lookup after the first call
        describe_simulated_chip()
        return device
    if holds_tpu:
        if _checked_tpu_device is None:
            import torch

            check_tpu_runtime()
            _checked_tpu_device = torch.device("tpu")
        return _checked_tpu_device
    import ray.train.torch

    return ray.train.torch.get_device()


# torch_tpu 0.2.0's names for the chips it recognizes (_internal/utils/hardware.py, _PCI_DEVICE_ID_TO_NAME)
TORCH_TPU_CHIP_NAMES = {"TPU-V4": "TPU v4", "TPU-V5P": "TPU v5p", "TPU-V5LITEPOD": "TPU v5e", "TPU-V6E": "TPU v6e",
                        "TPU-V7X": "TPU v7"}


def describe_simulated_chip() -> None:
    """Tell the simulated device which chip it stands for (the host's
    ``TPU_ACCELERATOR_TYPE``, e.g. ``v4-8``): ``torch.tpu.get_device_name()`` and
    ``get_device_properties().total_memory`` (HBM per device, from the topology
    table) answer as torch_tpu does on that chip. Without it they answer as
    torch_tpu on an unrecognized chip ("TPU", and a RuntimeError for the memory)."""
    from ray_train_tpu import topology
    from ray_train_tpu._compat import simulated_tpu_runtime

    pod_type = _environ.get(C.TPU_ACCELERATOR_TYPE)
    if not pod_type:
        return
    gen, _ = topology.parse_pod_type(pod_type)
    simulated_tpu_runtime.describe_chip(TORCH_TPU_CHIP_NAMES[gen.accelerator_type],
                                        gen.hbm_bytes_per_chip // gen.devices_per_chip)


def accelerator_memory() -> dict:
    """This process's accelerator memory, as its allocator counts it.

    ``{"allocated_bytes", "peak_bytes"[, "total_bytes"]}`` from ``torch.accelerator``:
    on a TPU, torch_tpu's ``TpuAllocator`` (a ``c10::DeviceAllocator``), i.e. the
    chip's HBM in use, the peak since the last ``reset_peak_memory_stats`` and the
    HBM per device (``get_memory_info``); on the simulated device, the bytes of
    live device tensors and the generation's HBM per device from the topology
    table (total omitted where the chip is unknown). ``{}`` in a process without
    an accelerator (the driver, a CPU worker). `ray_train_tpu.progress` and
    ``benchmarks/strategy_memory.py`` show it per chip.

    Example:
        >>> accelerator_memory()["peak_bytes"] / 2**30  # in a worker: GiB at peak  # doctest: +SKIP
        3.2
    """
    import torch

    if torch.accelerator.current_accelerator() is None:
        return {}
    index = torch.accelerator.current_device_index()
    stats = {"allocated_bytes": int(torch.accelerator.memory_allocated(index)),
             "peak_bytes": int(torch.accelerator.max_memory_allocated(index))}
    try:
        total = int(torch.accelerator.get_memory_info(index)[1])
    except (RuntimeError, NotImplementedError):  # a backend without memory info
        total = 0
    if total > 0:
        stats["total_bytes"] = total
    return stats


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> bool:
    """True if this CPU computes bfloat16 in hardware (flags read from /proc/cpuinfo,
    once per process: `compute_dtype` may be called every step).

    Example:
        >>> cpu_has_native_bf16("flags\t: fpu sse2 avx2 avx512f avx512_bf16")
        True
        >>> cpu_has_native_bf16("flags\t: fpu sse2 avx2 fma")
        False
    """
    if cpuinfo is None:
        return _this_cpu_has_native_bf16()
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


@functools.lru_cache(maxsize=1)
def _this_cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return cpu_has_native_bf16(f.read())
    except OSError:
        return False


def check_tpu_runtime() -> None:
    """Load torch_tpu and fail, naming what is missing, unless it gave us a "tpu"
    device and the "tpu_dist" backend. Never falls back to CPU."""
    import torch.distributed as dist

    from ray_train_tpu._compat import ray_train as compat_ray
    from ray_train_tpu._compat import torch as compat_torch

    try:
        compat_ray.load_tpu_dist_backend()  # torch_tpu._loader.load()
    except ImportError:
        raise RuntimeError(
            "this worker holds a TPU but torch_tpu is not installed: install "
            "'ray_train_tpu[tpu]' (torch-tpu, libtpu) on every TPU host, or set "
            f"{C.RAY_TRAIN_TPU_SIMULATE}=1 to simulate the slice on CPU"
        ) from None
    missing = []
    if compat_torch.privateuse1_backend_name() != "tpu":
        missing.append('"tpu" device')
    if "tpu_dist" not in dist.Backend.backend_list:
        missing.append('"tpu_dist" process-group backend')
    if missing:
        raise RuntimeError(
            f"torch_tpu is installed but registered no {' and no '.join(missing)} in "
            f"this worker; likely causes: {'; '.join(_tpu_diagnosis())}. ray_train_tpu "
            f"never falls back to CPU on a TPU host; set {C.RAY_TRAIN_TPU_SIMULATE}=1 "
            "to simulate on purpose"
        )


def _tpu_diagnosis() -> list[str]:
    from ray_train_tpu._compat import torch_tpu as compat_torch_tpu

    causes = []
    if compat_torch_tpu.tpu_chip_count() == 0:
        causes.append("no TPU chip is visible to this process (no TPU PCI device under /dev/vfio or /dev/accel*)")
    holder = _host.lockfile_holder(C.LIBTPU_LOCKFILE)
    if holder:
        causes.append(f"libtpu's lockfile {C.LIBTPU_LOCKFILE} is held by {_host.describe_holder(holder)}; "
                      "stop that process")
    if not _environ.get(C.TORCH_TPU_SLICEBUILDER_ADDRESSES):
        causes.append(f"{C.TORCH_TPU_SLICEBUILDER_ADDRESSES} was not applied to this worker")
    if _environ.get(C.TORCH_DEVICE_BACKEND_AUTOLOAD) == "0":
        causes.append(f"{C.TORCH_DEVICE_BACKEND_AUTOLOAD}=0 is set; unset it on TPU hosts")
    return causes or ["torch_tpu failed to initialise libtpu (see the worker log)"]
