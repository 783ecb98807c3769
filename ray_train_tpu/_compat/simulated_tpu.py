"""A simulated ``tpu`` device that is not the host: tensors on it refuse to meet host tensors.

Only for explicit simulation (``RAY_TRAIN_TPU_SIMULATE=1``). On a real TPU,
torch_tpu renames PyTorch's PrivateUse1 device slot to ``"tpu"`` and a tensor
there lives in the chip's HBM: an operation that mixes it with a host tensor
fails, and data reaches the device only by an explicit copy. A simulation whose
"device" is the CPU hides every such slip (a batch never moved, a device tensor
put in Ray's object store). Here the same slot is renamed ``"tpu"`` from
Python (torch's experimental ``_setup_privateuseone_for_python_backend``), and
every tensor on it is a `SimulatedTPUTensor`: a subclass over ordinary CPU
storage that reports ``device(type='tpu', index=0)`` (``dispatch_device``, the
way FakeTensor reports its fake device) and routes every operation through
``__torch_dispatch__``, which

- refuses an operation that mixes it with a host tensor of one or more
  dimensions, naming both devices, as CUDA does (0-dim host scalars are allowed,
  as on CUDA); copies (``.to``, ``copy_``, ``.cpu()``) are the way across;
- runs the operation with CPU kernels on views of the same storage and wraps
  what comes out, so that results stay on the device;
- runs collectives (``c10d`` ops, DTensor's functional collectives) on those CPU
  views, so gloo carries them: DDP, FSDP2, tensor parallel and DCP run unchanged.

Pickling a device tensor (``ray.put``, returning it from a Ray task) copies it
to the host, as torch does for a device tensor; unpickling rebuilds it on the
``tpu`` device, which fails in a process without a (simulated) TPU, such as the
driver, exactly where it would fail on a real slice.

The device has its own random-number generator, as a TPU does: random ops on
device tensors (dropout, ``normal_``, ...) draw from it, not from the CPU's, and
``torch.manual_seed`` seeds both (to different streams), so a checkpoint that
saves only the CPU generator does not resume bitwise here either.

Every private torch API this needs is used here and only here, pinned to
`constants.TORCH_VERSION`; tests/unit/test_compat.py checks each seam exists.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional

import torch

from ray_train_tpu._compat import simulated_tpu_dist
from ray_train_tpu._compat import simulated_tpu_runtime as _runtime

logger = logging.getLogger(__name__)

DEVICE_TYPE = "tpu"
TPU_DIST = simulated_tpu_dist.BACKEND_NAME  # torch_tpu's process-group backend, simulated over gloo
# One device per process, as torch_tpu under TPU_VISIBLE_CHIPS: index 0. torch
# parses "tpu" only once PrivateUse1 carries that name, so `install` makes it.
DEVICE: Optional[torch.device] = None

_aten = torch.ops.aten
_lock = threading.Lock()
_installed: dict = {}  # {"library": torch.library.Library} once installed in this process

_MIX_HINT = (
    "(SIMULATED TPU device: on a real TPU this fails too; move host data to the device with "
    "`.to(ray_train_tpu.get_device())`, and device results to the host with `.cpu()` or `.item()`)"
)


class DeviceMismatchError(RuntimeError):
    """A simulated TPU tensor met a host tensor in one operation."""


def _cpu_view(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor over `t`'s storage with `t`'s size, stride and offset."""
    out = torch.empty(0, dtype=t.dtype)
    out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    out.requires_grad_(False)
    return out


class SimulatedTPUTensor(torch.Tensor):
    """A tensor on the simulated ``tpu`` device (CPU storage underneath)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False):
        t = torch.Tensor._make_subclass(cls, elem, requires_grad, dispatch_device=True, device_for_backend_keys=DEVICE)
        _runtime.memory.track(t)  # its storage is device memory from now until it is freed
        return t

    @property
    def device(self) -> torch.device:  # what Python code reads; C++ asks prim.device below
        return DEVICE

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        # As torch pickles a device tensor without host storage: a host copy, rebuilt
        # on the device by torch's own function (allowed by weights_only loads). A
        # process without the simulated device (the driver) cannot rebuild it.
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (_cpu_view(self.detach()).clone(), self.dtype, str(DEVICE), self.requires_grad),
        )

    def tolist(self):  # a device-to-host copy, as on a TPU
        return _cpu_view(self.detach()).tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return _cpu_view(self.detach()).clone().numpy()
        raise TypeError(
            f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
            "memory first. (SIMULATED TPU device, as on a real one)"
        )

    def __format__(self, format_spec: str) -> str:
        if self.dim() == 0:  # as torch.Tensor formats a scalar: its item (a copy to the host)
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    def __repr__(self, *, tensor_contents=None) -> str:
        body = repr(_cpu_view(self.detach()))
        return body[:-1] + f", device='{DEVICE}')" if body.endswith(")") else body

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten_prim_device:
            return DEVICE
        if any(not issubclass(t, SimulatedTPUTensor) for t in types if t is not torch.Tensor):
            # Another tensor subclass (an AsyncCollectiveTensor a TP layer returns,
            # a DTensor) unwraps itself first; its op then reaches us with device
            # tensors only. Run first, we would hand it host views.
            return NotImplemented
        if _is_async_collective_wrap(func):
            from torch.distributed._functional_collectives import AsyncCollectiveTensor

            return AsyncCollectiveTensor(args[0])  # keeps the device tensor inside
        if _is_seeded(func):
            return _on_device_generator(func, args, kwargs)
        if func in _NO_TPU_KERNEL:
            raise NotImplementedError(
                f"{func} has no kernel for the tpu device (torch_tpu 0.2.0 registers none: fp16 GradScaler "
                "cannot unscale on a TPU); train in bfloat16 (torch.autocast('tpu', dtype=torch.bfloat16)), which "
                "needs no loss scaling (SIMULATED TPU device, as on a real one)")
        return _run_on_host_views(func, args, kwargs)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        copied = SimulatedTPUTensor(_cpu_view(self.detach()).clone(), self.requires_grad)
        if getattr(self, "_is_param", False):
            copied._is_param = True
        memo[id(self)] = copied
        return copied


def _run_on_host_views(func, args, kwargs):
    if _is_collective(func):
        if func.namespace == "c10d":  # ProcessGroupTpu's refusals (only tpu_dist serves device tensors)
            simulated_tpu_dist.check(func, args, kwargs)
        args, kwargs = _host_groups(func, args, kwargs)
    host_ok = func in _CROSS_DEVICE
    if func in _HOST_INDICES:  # indices may stay on the host, as CUDA allows
        cpu_args = (_unwrap_all(args[0], func, False), _unwrap_all(args[1], func, True),
                    *_unwrap_all(args[2:], func, False))
    else:
        cpu_args = _unwrap_all(args, func, host_ok)
    cpu_kwargs = _unwrap_all(kwargs, func, host_ok) if kwargs else kwargs
    if "device" in cpu_kwargs and _is_tpu(cpu_kwargs["device"]):
        cpu_kwargs = {**cpu_kwargs, "device": torch.device("cpu")}
    out = func(*cpu_args, **cpu_kwargs)
    for i, name in _written_tensor_arguments(func):
        original, view = (args[i], cpu_args[i]) if i < len(args) else (kwargs.get(name), cpu_kwargs.get(name))
        if isinstance(original, SimulatedTPUTensor):
            _follow_metadata(original, view)
    if func in _TO_HOST and not _is_tpu(kwargs.get("device", DEVICE)):
        return out  # .to("cpu") / .cpu(): the result lives on the host
    aliased = _aliased_arguments(func)
    if aliased is not None:  # in-place and out= ops return the tensors they wrote
        found = [args[i] if i < len(args) else kwargs[name] for i, name in aliased]
        return found[0] if len(found) == 1 else tuple(found)
    return _wrap_all(out)


# -- collectives: the simulated "tpu_dist" process group serves the device only, as torch_tpu's

_PG_TYPE = "__torch__.torch.classes.c10d.ProcessGroup"
_host_group_of: dict = {}  # group name -> its host twin


@functools.lru_cache(maxsize=None)
def _is_collective(func) -> bool:
    return func.namespace in ("c10d", "_c10d_functional")


def _host_groups(func, args, kwargs):
    """Replace each process group (object or, for functional collectives, name)
    with its host twin: the same gloo connections, serving host views."""
    names = {i for i, a in enumerate(func._schema.arguments) if a.name == "group_name"}
    args = tuple(_host_group(a, func, by_name=i in names) for i, a in enumerate(args))
    if "group_name" in kwargs:
        kwargs = {**kwargs, "group_name": _host_group(kwargs["group_name"], func, by_name=True)}
    return args, kwargs


def _host_group(arg, func, by_name: bool):
    from torch._C import _distributed_c10d as c10d

    if by_name and isinstance(arg, str):
        _twin(c10d._resolve_process_group(arg), func)
        return _host_name(arg)
    if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name() == _PG_TYPE:
        return _twin(c10d.ProcessGroup.unbox(arg), func).boxed()
    return arg


def _twin(group, func):
    """A process group whose host (CPU) backend is `group`'s device backend."""
    from torch._C import _distributed_c10d as c10d

    twin = _host_group_of.get(group.group_name)
    if twin is None:
        try:
            backend = group._get_backend(torch.device(DEVICE_TYPE))
        except RuntimeError:
            raise RuntimeError(
                f"{func}: process group {group.group_name!r} has no backend for device type {DEVICE_TYPE} "
                f"(its backend is {group._get_backend_name()!r}); on a TPU that fails too: use the job's "
                "default group (tpu_dist) for device tensors, or move them to the host first"
            ) from None
        twin = c10d.ProcessGroup(group.rank(), group.size())
        twin._register_backend(torch.device("cpu"), c10d.ProcessGroup.BackendType.GLOO, backend)
        twin._set_default_backend(c10d.ProcessGroup.BackendType.GLOO)
        # registered under a name of its own (its backend, and so its group_name, is the group's)
        c10d._register_process_group(_host_name(group.group_name), twin)
        _host_group_of[group.group_name] = twin
    return twin


def _host_name(group_name: str) -> str:
    return f"{group_name}:host"


@functools.lru_cache(maxsize=None)
def _is_seeded(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _on_device_generator(func, args, kwargs):
    """Run a random op with the device's generator in place of the CPU's."""
    given = [g for g in (kwargs.get("generator"), *args) if isinstance(g, torch.Generator)]
    # (a generator comes back from C++ as a new Python object: the device's is known by its state)
    if any(not torch.equal(g.get_state(), _device_generator.get_state()) for g in given):
        raise RuntimeError(
            f"{func}: a generator of device 'cpu' cannot drive a random op on {DEVICE} (as on a TPU); "
            "leave generator=None or pass torch.tpu.default_generators[0] (the device's generator, seeded by "
            "torch.manual_seed), or draw on the host and move the result"
        )
    if given:  # the device's own generator: the one used below anyway
        args = tuple(None if isinstance(a, torch.Generator) else a for a in args)
        kwargs = {**kwargs, "generator": None} if "generator" in kwargs else kwargs
    cpu = torch.default_generator
    host_state = cpu.get_state()
    cpu.set_state(_device_generator.get_state())
    try:
        return _run_on_host_views(func, args, kwargs)
    finally:
        _device_generator.set_state(cpu.get_state())
        cpu.set_state(host_state)


_device_generator = _runtime.device_generator  # the device's own stream (CPU kernels draw from it)


def _is_tpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == DEVICE_TYPE


def _unwrap(x: Any, func, host_ok: bool) -> Any:
    if isinstance(x, SimulatedTPUTensor):
        return _cpu_view(x)
    if type(x) is torch.Tensor and not host_ok and x.dim() > 0 and x.device.type == "cpu":
        raise DeviceMismatchError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{DEVICE} and cpu! (in {func}) {_MIX_HINT}"
        )
    return x


def _unwrap_all(tree: Any, func, host_ok: bool) -> Any:
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unwrap_all(x, func, host_ok) for x in tree)
    if isinstance(tree, dict):
        return {k: _unwrap_all(v, func, host_ok) for k, v in tree.items()}
    return _unwrap(tree, func, host_ok)


def _wrap_all(tree: Any) -> Any:
    if type(tree) is torch.Tensor:
        return SimulatedTPUTensor(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_wrap_all(x) for x in tree)
    return tree


def _follow_metadata(t: "SimulatedTPUTensor", view: torch.Tensor) -> None:
    """After an op that may change a tensor's shape or storage in place (resize_,
    set_, an out= whose size was wrong ...) ran on `t`'s host view, give `t` the
    view's size, stride, offset and storage (``.data =`` copies a tensor's
    metadata without an op, so it cannot recurse into this dispatch)."""
    if (t.shape != view.shape or t.stride() != view.stride() or t.storage_offset() != view.storage_offset()
            or t.untyped_storage()._cdata != view.untyped_storage()._cdata):
        t.data = SimulatedTPUTensor(view)


@functools.lru_cache(maxsize=None)
def _written_tensor_arguments(func) -> tuple:
    """``(position, name)`` of the single-tensor arguments an op writes."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write and isinstance(a.type, torch.TensorType))


@functools.lru_cache(maxsize=None)
def _aliased_arguments(func) -> Optional[tuple]:
    """For an op whose every result is an argument it wrote (in-place, out=):
    ``(position, name)`` of that argument per result; else None."""
    schema = func._schema
    if not schema.returns:
        return None
    found = []
    for result in schema.returns:
        if result.alias_info is None or not result.alias_info.is_write:
            return None
        match = [(i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.before_set == result.alias_info.before_set]
        if len(match) != 1:
            return None
        found.append(match[0])
    return tuple(found)


_aten_prim_device = torch.ops.prim.device.default


@functools.lru_cache(maxsize=None)
def _is_async_collective_wrap(func) -> bool:
    """DTensor's functional collectives wrap results in AsyncCollectiveTensor
    through this op (registered when torch.distributed imports it): it must wrap
    the device tensor itself, not its host view."""
    return func.name() == "_c10d_functional::_wrap_tensor_autograd"

# Ops that move data between host and device: a host tensor is allowed there.
_CROSS_DEVICE = frozenset({_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
                           _aten._copy_from_and_resize.default})
_TO_HOST = frozenset({_aten._to_copy.default})
# Ops torch_tpu has no kernel for (none in its libraries): what fp16 loss scaling needs.
_NO_TPU_KERNEL = frozenset({_aten._amp_foreach_non_finite_check_and_unscale_.default,
                            _aten._amp_update_scale_.default})
# Indexing ops whose index tensors (second argument) may be host tensors.
_HOST_INDICES = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                           _aten._index_put_impl_.default})


# -- the backend: PrivateUse1 named "tpu", a device module, kernels that create device tensors

_DeviceModule = _runtime.DeviceModule


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return SimulatedTPUTensor(torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return SimulatedTPUTensor(torch.empty_strided(size, stride, dtype=dtype))


def _as_host(t: torch.Tensor) -> torch.Tensor:
    return _cpu_view(t) if isinstance(t, SimulatedTPUTensor) else t


def _copy_from(src, dst, non_blocking: bool = False):
    _as_host(dst).copy_(_as_host(src))
    return dst


def _copy_from_and_resize(src, dst):
    if isinstance(dst, SimulatedTPUTensor):
        dst.resize_(src.shape)  # through __torch_dispatch__
    _as_host(dst).copy_(_as_host(src))
    return dst


def _route_accelerator_streams() -> None:
    """``torch.accelerator.current_stream()`` asks the device guard for a stream, and
    a guard written in Python (torch 2.13) answers with no valid device (FSDP2's
    ``finalize_backward`` calls it when a frozen parameter left an unshard
    pending: "Unknown device: -128"). For this device it is the device module's
    one stream, as ``torch.tpu.current_stream()`` is."""
    original = torch.accelerator.current_stream

    def current_stream(device=None, /):
        if device is None or isinstance(device, int) or torch.device(device).type == DEVICE_TYPE:
            return _DeviceModule.current_stream()
        return original(device)

    current_stream.__wrapped__ = original
    torch.accelerator.current_stream = current_stream


def install() -> torch.device:
    """Register the simulated ``tpu`` device in this process (idempotent) and
    return ``torch.device("tpu")``, as Ray's TPU device manager gives it. Refuses when PrivateUse1 already belongs to another backend
    (torch_tpu loaded: a real TPU process must not simulate)."""
    global DEVICE
    with _lock:
        if _installed:
            return _installed["device"]
        name = torch._C._get_privateuse1_backend_name()
        if name != "privateuseone":
            raise RuntimeError(
                f"cannot simulate a TPU device: PyTorch's PrivateUse1 device is already {name!r} in this "
                "process (torch_tpu loaded?). Simulated workers need TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
                "before torch is imported (simulated_tpu_cluster sets it)"
            )
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(
            DEVICE_TYPE, backend_module=_DeviceModule(), hook=_Hooks(), device_guard=_Guard()
        )
        library = torch.library.Library("aten", "IMPL")
        for op, kernel in (("empty.memory_format", _empty), ("empty_strided", _empty_strided),
                           ("_copy_from", _copy_from), ("_copy_from_and_resize", _copy_from_and_resize)):
            library.impl(op, kernel, "PrivateUse1")
        import torch.distributed as dist

        dist.Backend.register_backend(TPU_DIST, simulated_tpu_dist.create_group, devices=[DEVICE_TYPE])
        _route_accelerator_streams()
        DEVICE = torch.device(DEVICE_TYPE, 0)
        libraries = [library]
        _runtime.install_autocast(libraries)
        _runtime.install_pinned_memory(libraries)
        _runtime.install_load()
        _runtime.route_accelerator()
        _runtime.install_compile_backend(SimulatedTPUTensor)
        # what torch_tpu's users get from Ray: torch.device("tpu"), tensors then on tpu:0
        _installed.update(libraries=libraries, device=torch.device(DEVICE_TYPE))
        return _installed["device"]


def install_host_stand_in() -> torch.device:
    """The kinder simulation (``RAY_TRAIN_TPU_SIMULATE_DEVICE=host``): the device
    is the CPU itself and ``tpu_dist`` is gloo for host tensors. Host/device slips
    go unnoticed; only for comparing per-step overhead with CPU baselines."""
    import torch.distributed as dist

    with _lock:
        if _installed:
            raise RuntimeError("this process already has the simulated 'tpu' device; it cannot also use the host")
        if TPU_DIST not in dist.Backend.backend_list:
            dist.Backend.register_backend(TPU_DIST, simulated_tpu_dist.create_group, devices=["cpu"])
            logger.warning(
                "ray_train_tpu: SIMULATED with the host as the device (RAY_TRAIN_TPU_SIMULATE_DEVICE=host): "
                "a batch never moved to the device, or a device tensor put in the object store, goes unnoticed"
            )
    return torch.device("cpu")


def installed() -> bool:
    """True once `install` ran in this process."""
    return bool(_installed)


def host_tensor(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The host view of a simulated device tensor (same storage), for tests."""
    return _cpu_view(t) if isinstance(t, SimulatedTPUTensor) else None
