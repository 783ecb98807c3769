"""compute_dtype(): bfloat16 where the hardware computes it, float32 on a simulated
slice whose CPU would only emulate it."""

import pytest
import torch

from ray_train_tpu import constants as C
from ray_train_tpu import device

X86_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_NO_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


@pytest.mark.parametrize(
    "cpuinfo, native",
    [(X86_AVX2, False), (X86_BF16, True), (X86_AMX, True), (ARM_BF16, True), (ARM_NO_BF16, False), ("", False)],
)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    assert device.cpu_has_native_bf16(cpuinfo) is native


def test_a_flag_that_only_contains_bf16_does_not_count():
    assert not device.cpu_has_native_bf16("flags\t: avx512_fp16 bf16x avx_vnni_bf16_like\n")


@pytest.mark.parametrize("native", [True, False])
def test_simulated_slice_computes_in_bf16_only_where_native(monkeypatch, native):
    monkeypatch.setenv(C.RAY_TRAIN_TPU_SIMULATE, "1")
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda cpuinfo=None: native)
    assert device.compute_dtype() == (torch.bfloat16 if native else torch.float32)


def test_outside_simulation_it_is_always_bf16(monkeypatch):
    monkeypatch.delenv(C.RAY_TRAIN_TPU_SIMULATE, raising=False)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda cpuinfo=None: False)
    assert device.compute_dtype() == torch.bfloat16


def test_public():
    import ray_train_tpu

    assert ray_train_tpu.compute_dtype is device.compute_dtype
    assert "compute_dtype" in ray_train_tpu.__all__


def test_get_device_checks_the_tpu_runtime_once_per_process(monkeypatch):
    """A loop may call get_device() every step: the torch_tpu check runs at the
    first call only, but the worker's TPU assignment is looked up every time."""
    import ray
    import ray.train.torch

    monkeypatch.delenv(C.RAY_TRAIN_TPU_SIMULATE, raising=False)
    monkeypatch.setattr(device, "_checked_tpu_device", None)
    checks, assigned = [], {"TPU": ["0"]}

    class Context:
        def get_accelerator_ids(self):
            return dict(assigned)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    monkeypatch.setattr(device, "check_tpu_runtime", lambda: checks.append(1))
    monkeypatch.setattr(torch, "device", lambda kind: f"device({kind})")
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: "ray's device")
    assert [device.get_device() for _ in range(5)] == ["device(tpu)"] * 5
    assert checks == [1]
    assigned.pop("TPU")  # a later task of this process holds no TPU: not the cached device
    assert device.get_device() == "ray's device"


def test_get_device_fails_at_every_call_until_the_runtime_is_there(monkeypatch):
    import ray

    monkeypatch.delenv(C.RAY_TRAIN_TPU_SIMULATE, raising=False)
    monkeypatch.setattr(device, "_checked_tpu_device", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"get_accelerator_ids": lambda self: {"TPU": ["0"]}})())

    def missing():
        raise RuntimeError("torch_tpu registered no tpu device")

    monkeypatch.setattr(device, "check_tpu_runtime", missing)
    for _ in range(2):  # a failed check is not cached as a pass
        with pytest.raises(RuntimeError, match="registered no tpu device"):
            device.get_device()
    assert device._checked_tpu_device is None


def test_cpu_flags_are_read_once_per_process(monkeypatch):
    import builtins

    device._this_cpu_has_native_bf16.cache_clear()
    opened = []
    real_open = builtins.open

    def counting_open(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    try:
        first = device.cpu_has_native_bf16()
        assert [device.cpu_has_native_bf16() for _ in range(3)] == [first] * 3
        assert len(opened) == 1
    finally:
        device._this_cpu_has_native_bf16.cache_clear()
