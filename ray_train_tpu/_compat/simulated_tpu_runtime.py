"""What torch_tpu 0.2.0 gives a training loop besides tensors, for the simulated ``tpu`` device.

`simulated_tpu` makes tensors that live on a ``tpu`` device that is not the
host. This module gives that device the rest of torch_tpu's public device
surface (``torch_tpu/_internal/device/_device_module.py``, its
``TpuDeviceModule``), so that an ordinary TPU training script runs unchanged in
simulation:

- ``torch.tpu`` (`DeviceModule`): every public name of torch_tpu's device module
  class; the few that only make sense on a chip (XLA precision flags, eager-mode
  deferral, the topology-aware mesh) refuse with `NotSimulatedError`, listed in
  `REFUSED` (tests/unit/test_simulated_device.py reads torch_tpu's class and
  requires each name here, and each refusal to refuse).
- **Autocast** for ``"tpu"``: ``torch.autocast("tpu", dtype=torch.bfloat16)``
  casts as torch_tpu's AutocastPrivateUse1 kernels do. The op lists and each
  op's cast policy are read from torch_tpu's own binary (the
  ``at::autocast::WrapFunction_<CastPolicy, PrivateUse1, ..., at::_ops::<op>>``
  instantiations in its glue library, `torch_tpu_autocast_ops`); without
  torch_tpu installed, a short list of matmul-type ops (`FALLBACK_AUTOCAST_OPS`).
- **Memory statistics** (`memory`): the bytes of the storages of live device
  tensors, as a device allocator counts them (allocated, peak, reset); PyTorch's
  ``torch.accelerator.memory_*`` read them (its C entry points are routed here,
  as a C++ backend's ``c10::DeviceAllocator`` would answer them). There is no
  cache: ``empty_cache`` frees nothing and ``reserved == allocated``.
- ``torch.accelerator.synchronize`` (every op already ran when it returns).
- ``torch.load(f, map_location="tpu:0")`` (`install_load`): loaded on the host,
  then every tensor copied to the device (torch's storage restore cannot be
  carried by a Python backend).
- **Pinned host memory** for ``DataLoader(pin_memory=True)``: ``Tensor.pin_memory()``
  gives a host copy that ``is_pinned()`` (ordinary pageable memory underneath:
  it only lets the same code run).
- **Streams and events** as torch_tpu has them: one in-order stream; events
  time on the host, as torch_tpu documents its ``elapsed_time``.
- A ``"tpu"`` TorchDynamo backend (`install_compile_backend`), as torch_tpu
  registers one: ``torch.compile(model, backend="tpu")`` runs the captured graph
  with the device's kernels (the host's), forward and backward equal to eager.

What a Python backend cannot carry (PyTorch's PrivateUse1 hooks written in
Python implement only ``is_available``/``is_built``/``has_primary_context``):
``torch.Generator(device="tpu")`` (use ``torch.tpu.default_generators[0]`` or
``torch.manual_seed``), ``torch.empty(..., pin_memory=True)``. Both fail with
PyTorch's own NotImplementedError; docs/simulation.md lists them.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import re
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)

DEVICE_TYPE = "tpu"


class NotSimulatedError(NotImplementedError):
    """A torch_tpu device API that has no meaning off a chip."""


def _refuse(name: str, why: str) -> Callable:
    def refused(*args, **kwargs):
        raise NotSimulatedError(
            f"torch.tpu.{name} is not simulated: {why} (SIMULATED TPU device; on a TPU, torch_tpu provides it)"
        )

    refused.__name__ = name
    return refused


# -- memory: the bytes of live device storages, as a device allocator counts them

class _Memory:
    """Counts the storages of simulated device tensors: a storage counts from the
    first device tensor over it until it is freed (PyTorch keeps a storage's
    Python object alive exactly as long as the storage, so a finalizer on it
    fires at the free)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}  # storage key -> bytes
        self.current = self.peak = self.allocated = self.freed = 0
        self.count = self.count_peak = self.count_allocated = self.count_freed = 0

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.current += nbytes
            self.allocated += nbytes
            self.peak = max(self.peak, self.current)
            self.count += 1
            self.count_allocated += 1
            self.count_peak = max(self.count_peak, self.count)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is None:
                return
            self.current -= nbytes
            self.freed += nbytes
            self.count -= 1
            self.count_freed += 1

    def reset_peak(self) -> None:
        with self._lock:
            self.peak, self.count_peak = self.current, self.count

    def reset_accumulated(self) -> None:
        with self._lock:
            self.allocated = self.freed = self.count_allocated = self.count_freed = 0

    def stats(self) -> dict:
        """Nested as PyTorch's ``c10::CachingDeviceAllocator::DeviceStats`` (what
        ``torch.accelerator.memory_stats`` flattens)."""
        with self._lock:
            nbytes = {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}
            count = {"current": self.count, "peak": self.count_peak, "allocated": self.count_allocated,
                     "freed": self.count_freed}
        pools = lambda stat: {"all": dict(stat), "large_pool": dict(stat), "small_pool": _zero()}  # noqa: E731
        return {
            "allocated_bytes": pools(nbytes), "reserved_bytes": pools(nbytes), "active_bytes": pools(nbytes),
            "requested_bytes": pools(nbytes), "allocation": pools(count), "segment": pools(count),
            "active": pools(count), "inactive_split": {p: _zero() for p in ("all", "large_pool", "small_pool")},
            "inactive_split_bytes": {p: _zero() for p in ("all", "large_pool", "small_pool")},
            "num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0,
            "num_device_alloc": count["allocated"], "num_device_free": count["freed"],
            "oversize_allocations": _zero(), "oversize_segments": _zero(), "max_split_size": 0,
        }


def _zero() -> dict:
    return {"current": 0, "peak": 0, "allocated": 0, "freed": 0}


memory = _Memory()


# -- the chip: name and HBM per device, from the package's topology table (described by device.py)

_chip: dict = {}


def describe_chip(name: str, hbm_bytes_per_device: int) -> None:
    """What ``get_device_name`` / ``get_device_properties`` answer: torch_tpu's name
    for the generation ("TPU v4") and the HBM one device addresses."""
    _chip.update(name=name, total_memory=int(hbm_bytes_per_device))


class TpuDeviceProperties:
    """torch_tpu's ``_TpuDeviceProperties``: name, total_memory (HBM per device), multi_processor_count."""

    def __init__(self, name: str, total_memory: int, multi_processor_count: int = 1):
        self.name, self.total_memory, self.multi_processor_count = name, total_memory, multi_processor_count

    def __repr__(self) -> str:
        return (f"_TpuDeviceProperties(name={self.name!r}, total_memory={self.total_memory}, "
                f"multi_processor_count={self.multi_processor_count})")


# -- streams and events: one in-order queue, as the device's default stream

class Stream:
    """torch_tpu's ``TpuStream`` in simulation: every op has run when it returns, so
    waits are no-ops and queries are True."""

    def __init__(self, device=None, priority: int = 0, stream_id: int = 0, **_):
        self.device_index, self.device_type, self.priority, self.stream_id = 0, DEVICE_TYPE, priority, stream_id

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, 0)

    def wait_event(self, event) -> None: ...

    def wait_stream(self, stream) -> None: ...

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...

    def priority_range(self):
        return (0, 0)

    @property
    def is_sparse(self) -> bool:
        return False

    @property
    def is_dense(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None: ...

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash((DEVICE_TYPE, self.stream_id))


class Event:
    """torch_tpu's ``TpuEvent``: ``elapsed_time`` is measured on the host, as
    torch_tpu documents its own (milliseconds between the two records)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False, device=None):
        self.enable_timing = enable_timing
        self._recorded_at: Optional[float] = None

    def record(self, stream=None) -> "Event":
        self._recorded_at = time.perf_counter()
        return self

    def wait(self, stream=None) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True to measure elapsed time")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end_event._recorded_at - self._recorded_at) * 1e3

    @classmethod
    def from_ipc_handle(cls, device, handle):
        raise NotImplementedError("TpuEvent.from_ipc_handle is not implemented (as in torch_tpu 0.2.0)")

    def ipc_handle(self):
        raise NotImplementedError("TpuEvent.ipc_handle is not implemented (as in torch_tpu 0.2.0)")


_default_stream = Stream()


class EagerMode(enum.Enum):
    """torch_tpu's eager execution modes. The simulation runs every op when it is
    called (``DEFER_NEVER``); setting another mode is recorded, not acted on."""

    DEFER_AND_FUSE = "DEFER_AND_FUSE"
    DEFER_NEVER = "DEFER_NEVER"
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "DEFER_NEVER_AND_LAUNCH_BLOCKING"


# -- the device's generator: the CPU's kernels draw from a stream of the device's own

device_generator = torch.Generator()
# torch.manual_seed(s) seeds every device; the device's stream differs from the CPU's for the same
# seed, as a TPU's or GPU's does (another algorithm), so a host/device mix-up cannot go unnoticed.
_DEVICE_SEED_OFFSET = 0x7470755F726E67  # "tpu_rng"


def _check_index(device) -> None:
    if device is None:
        return
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type not in (DEVICE_TYPE, "cpu") or device.type == "cpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        index = device.index
    else:
        index = device
    if index not in (None, 0, -1):
        raise RuntimeError(f"this worker has one TPU device (tpu:0); cannot use device {device!r}")


class _DeviceContext:
    """``torch.tpu.device(i)``: one device per process, so only ``0`` (or None/-1)."""

    def __init__(self, device: Any):
        _check_index(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class _DeviceOfContext(_DeviceContext):
    def __init__(self, obj: Any):
        super().__init__(obj.get_device() if getattr(getattr(obj, "device", None), "type", None) == DEVICE_TYPE
                         else None)


class DeviceModule:
    """``torch.tpu`` in a simulated worker: torch_tpu's ``TpuDeviceModule`` surface
    for one device. Names torch_tpu has and the simulation cannot give are in
    `REFUSED`, each raising `NotSimulatedError`."""

    Stream = Stream
    Event = Event
    EagerMode = EagerMode
    device = _DeviceContext
    device_of = _DeviceOfContext
    _autocast_dtype = torch.bfloat16  # torch_tpu's _DeviceModule._autocast_dtype
    _eager_mode = EagerMode.DEFER_NEVER
    _initialized = True

    # -- devices
    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _lazy_init() -> None: ...

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        _check_index(device)

    @staticmethod
    def _exchange_device(device: int) -> int:
        _check_index(device)
        return 0

    _maybe_exchange_device = _exchange_device

    @staticmethod
    def get_device_name(device=None) -> str:
        return _chip.get("name", "TPU")  # torch_tpu's answer when it recognizes no chip

    @staticmethod
    def get_device_properties(device=None) -> TpuDeviceProperties:
        name = DeviceModule.get_device_name(device)
        if "total_memory" not in _chip:  # torch_tpu's refusal for an unrecognized chip
            raise RuntimeError(f"unrecognized TPU {name!r}; cannot determine device memory")
        return TpuDeviceProperties(name=name, total_memory=_chip["total_memory"])

    @staticmethod
    def _get_compute_capability(device=None) -> str:
        return ""

    @staticmethod
    def _is_gpu() -> bool:
        return False

    @staticmethod
    def _is_triton_capable(device=None) -> bool:
        return False

    @staticmethod
    def _get_multi_processor_count(device=None) -> int:
        return 1

    # -- streams
    @staticmethod
    def synchronize(device=None) -> None: ...

    @staticmethod
    def current_stream(device=None) -> Stream:
        return _default_stream

    @staticmethod
    def default_stream(device=None) -> Stream:
        return _default_stream

    @staticmethod
    def set_stream(stream) -> None: ...

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext(stream)

    # -- random numbers: the device's own generator; torch.manual_seed calls manual_seed_all
    @staticmethod
    def manual_seed(seed: int) -> None:
        device_generator.manual_seed((int(seed) + _DEVICE_SEED_OFFSET) % 2**64)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        DeviceModule.manual_seed(seed)

    @staticmethod
    def initial_seed() -> int:
        return (device_generator.initial_seed() - _DEVICE_SEED_OFFSET) % 2**64

    @staticmethod
    def get_rng_state(device=DEVICE_TYPE) -> torch.Tensor:
        _check_index(device)
        return device_generator.get_state()

    @staticmethod
    def set_rng_state(state, device=DEVICE_TYPE) -> None:
        _check_index(device)
        device_generator.set_state(state)

    @staticmethod
    def _get_generator(device=None) -> torch.Generator:
        _check_index(device)
        return device_generator

    default_generators = (device_generator,)

    # -- automatic mixed precision (torch.autocast reads these)
    @staticmethod
    def get_amp_supported_dtype() -> list:
        return list(amp_supported_dtypes())

    @staticmethod
    def _is_autocast_enabled() -> bool:
        return torch.is_autocast_enabled(DEVICE_TYPE)

    @staticmethod
    def _get_autocast_dtype() -> torch.dtype:
        return torch.get_autocast_dtype(DEVICE_TYPE)

    @staticmethod
    def _set_autocast_enabled(enabled: bool) -> None:
        torch.set_autocast_enabled(DEVICE_TYPE, enabled)

    @staticmethod
    def _set_autocast_dtype(dtype: torch.dtype) -> None:
        supported = DeviceModule.get_amp_supported_dtype()
        if dtype not in supported:
            raise ValueError(f"Unsupported dtype {dtype} for AMP. Supported dtypes are: {supported}")
        torch.set_autocast_dtype(DEVICE_TYPE, dtype)

    # -- memory (torch.cuda's names, as torch.tpu users reach for them; the same numbers as torch.accelerator)
    @staticmethod
    def memory_allocated(device=None) -> int:
        return memory.current

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return memory.peak

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        memory.reset_peak()

    @staticmethod
    def memory_stats(device=None) -> dict:
        return torch.accelerator.memory_stats(device)

    @staticmethod
    def empty_cache() -> None: ...

    # -- eager mode: recorded; the simulation never defers
    @staticmethod
    def set_eager_mode(mode) -> None:
        DeviceModule._eager_mode = EagerMode(getattr(mode, "value", mode)) if not isinstance(mode, EagerMode) else mode

    @property
    def eager_mode(self) -> EagerMode:
        return DeviceModule._eager_mode

    # -- what only a chip has (names torch_tpu's class defines)
    precision = staticmethod(_refuse("precision", "StableHLO matmul precision is an XLA compiler setting; "
                                     "the host's kernels compute in each tensor's dtype"))
    Precision = staticmethod(_refuse("Precision", "StableHLO precision is an XLA compiler setting"))
    topology_aware_mesh = staticmethod(_refuse(
        "topology_aware_mesh", "deprecated in torch_tpu 0.2.0 (use torch.tpu.distributed.topology_aware_mesh on a "
        "TPU); in simulation build meshes with ray_train_tpu.mesh"))

    @property
    def allow_excess_precision(self):
        return _refuse("allow_excess_precision", "an XLA compiler flag (--allow_excess_precision)")()


REFUSED = frozenset({"precision", "Precision", "topology_aware_mesh", "allow_excess_precision"})


# -- automatic mixed precision: torch_tpu's AutocastPrivateUse1 op lists

# c10::DeviceType::PrivateUse1 and at::autocast::CastPolicy's order (ATen/autocast_mode.h).
_PRIVATEUSE1 = 20
CAST_POLICIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote")
# Without torch_tpu installed: the matmul-type ops every backend runs in the lower precision.
FALLBACK_AUTOCAST_OPS = {name: "lower_precision_fp" for name in (
    "mm", "bmm", "matmul", "linear", "addmm", "addbmm", "baddbmm", "conv1d", "conv2d", "conv3d", "einsum",
    "scaled_dot_product_attention")}
_WRAP = re.compile(rb"WrapFunction_ILNS0_10CastPolicyE(\d)ELN3c1010DeviceTypeE" + str(_PRIVATEUSE1).encode()
                   + rb"E.*?XadL_ZNS_4_ops(\d+)")


def torch_tpu_glue_library() -> Optional[str]:
    """The path of torch_tpu's glue library for this torch (where its autocast kernels
    are instantiated), or None when torch_tpu is not installed. Found without importing
    torch_tpu (a simulated process must not load it)."""
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("torch_tpu")
    if spec is None or not spec.submodule_search_locations:
        return None
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    tag = f"{major}_{minor}_0"
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "csrc" / "common" / f"glue_{tag}" / \
        f"libpywrap_{tag}_common.so"
    return str(path) if path.exists() else None


@functools.lru_cache(maxsize=None)
def torch_tpu_autocast_ops(path: Optional[str] = None) -> dict:
    """``{aten op struct name: cast policy}`` of torch_tpu's autocast kernels for its
    device, read from the symbols of its glue library (each kernel is an
    ``at::autocast::WrapFunction_<policy, PrivateUse1, ..., &at::_ops::<op>::call>``)."""
    path = path or torch_tpu_glue_library()
    if path is None:
        return {}
    with open(path, "rb") as f:
        blob = f.read()
    found = {}
    for m in _WRAP.finditer(blob):
        n = int(m.group(2))
        name = blob[m.end():m.end() + n].decode("ascii", "replace")
        found.setdefault(name, CAST_POLICIES[int(m.group(1))])
    return found


def _overload(struct_name: str):
    """The aten OpOverload of an ``at::_ops`` struct name (``conv1d_padding`` -> ``aten.conv1d.padding``)."""
    packet = getattr(torch.ops.aten, struct_name, None)
    if packet is not None and "default" in packet.overloads():
        return packet.default
    for i in range(len(struct_name) - 1, 0, -1):
        if struct_name[i] != "_":
            continue
        packet = getattr(torch.ops.aten, struct_name[:i], None)
        if packet is not None and struct_name[i + 1:] in packet.overloads():
            return getattr(packet, struct_name[i + 1:])
    return None


@functools.lru_cache(maxsize=None)
def amp_supported_dtypes() -> tuple:
    """torch_tpu's ``_AMP_SUPPORTED_DTYPES``: every dtype a TPU computes in (torch_tpu 0.2.0)."""
    return (torch.bfloat16, torch.bool, torch.complex128, torch.complex64, torch.float16, torch.float32,
            torch.float64, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
            torch.float8_e8m0fnu, torch.int16, torch.int32, torch.int64, torch.int8, torch.uint16, torch.uint32,
            torch.uint64, torch.uint8)


_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)
_LOWER = (torch.float16, torch.bfloat16)


def _eligible(x: Any) -> bool:
    # as at::autocast::is_autocast_eligible: a floating, non-double tensor on the device
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 and \
        x.device.type == DEVICE_TYPE


def _cast_tree(tree: Any, to: Callable[[torch.Tensor], Optional[torch.dtype]]) -> Any:
    if isinstance(tree, torch.Tensor):
        dtype = to(tree) if _eligible(tree) else None
        return tree.to(dtype) if dtype is not None and dtype != tree.dtype else tree
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cast_tree(x, to) for x in tree)
    return tree


def _autocast_kernel(op, policy: str) -> Callable:
    schema_args = [a.name for a in op._schema.arguments]
    dtype_at = schema_args.index("dtype") if "dtype" in schema_args else None

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            if policy == "lower_precision_fp":
                low = torch.get_autocast_dtype(DEVICE_TYPE)
                args, kwargs = _cast_tree(args, lambda t: low), {k: _cast_tree(v, lambda t: low)
                                                                 for k, v in kwargs.items()}
            elif policy == "promote":
                widest = None
                for x in [*args, *kwargs.values()]:
                    for t in (x if isinstance(x, (list, tuple)) else (x,)):
                        if _eligible(t):
                            widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
                if widest is not None:
                    args = _cast_tree(args, lambda t: widest)
                    kwargs = {k: _cast_tree(v, lambda t: widest) for k, v in kwargs.items()}
            elif policy == "fp32_set_opt_dtype" and dtype_at is not None:
                # as at::autocast: if the caller set no dtype and an input is lower precision, compute in fp32
                given = args[dtype_at] if len(args) > dtype_at else kwargs.get("dtype")
                lowered = any(_eligible(t) and t.dtype in _LOWER for t in args if isinstance(t, torch.Tensor))
                if given is None and lowered:
                    if len(args) > dtype_at:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
            else:  # fp32, fp32_append_dtype (and fp32_set_opt_dtype without a dtype argument)
                to32 = lambda t: torch.float32 if t.dtype in _LOWER else None  # noqa: E731
                args, kwargs = _cast_tree(args, to32), {k: _cast_tree(v, to32) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return kernel


def autocast_ops() -> dict:
    """``{OpOverload: cast policy}`` the simulated device's autocast applies:
    torch_tpu's own lists when it is installed, else `FALLBACK_AUTOCAST_OPS`."""
    named = torch_tpu_autocast_ops() or FALLBACK_AUTOCAST_OPS
    ops = {}
    for struct_name, policy in named.items():
        op = _overload(struct_name)
        if op is not None:
            ops[op] = policy
    return ops


def install_autocast(libraries: list) -> None:
    """Register the ``AutocastPrivateUse1`` kernels: torch_tpu's op lists, and a
    fallthrough for every other op (as PyTorch registers for its own backends)."""
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    kernels = torch.library.Library("aten", "IMPL")
    for op, policy in autocast_ops().items():
        name = op._schema.name.split("::", 1)[1]
        if op._overloadname != "default":
            name += "." + op._overloadname
        kernels.impl(name, _autocast_kernel(op, policy), "AutocastPrivateUse1")
    torch.set_autocast_dtype(DEVICE_TYPE, DeviceModule._autocast_dtype)
    libraries += [fallback, kernels]


# -- pinned host memory (DataLoader(pin_memory=True))

_pinned: dict[int, bool] = {}


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    return self.untyped_storage()._cdata in _pinned


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    if device is not None and torch.device(device).type not in (DEVICE_TYPE, "cpu"):
        raise RuntimeError(f"cannot pin host memory for device {device} in a simulated TPU process")
    copy = torch.empty_like(self, memory_format=torch.contiguous_format).copy_(self)
    storage = copy.untyped_storage()
    key = storage._cdata
    _pinned[key] = True
    weakref.finalize(storage, _pinned.pop, key, None)
    return copy


def install_pinned_memory(libraries: list) -> None:
    library = torch.library.Library("aten", "IMPL")
    library.impl("is_pinned", _is_pinned, "CPU")
    library.impl("_pin_memory", _pin_memory, "CPU")
    libraries.append(library)


# -- torch.load(..., map_location="tpu:0")

def _names_device(location: Any) -> bool:
    return isinstance(location, (str, torch.device)) and torch.device(location).type == DEVICE_TYPE


def _to_device(tree: Any, device: torch.device) -> Any:
    """Every host tensor of a loaded object on `device`, one copy per tensor object
    (a tensor that appears twice stays one tensor)."""
    from torch.utils._pytree import tree_map_only

    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            moved[id(t)] = t if t.device.type == DEVICE_TYPE else t.to(device)
        return moved[id(t)]

    return tree_map_only(torch.Tensor, move, tree)


def install_load() -> None:
    """``torch.load(f, map_location="tpu:0")`` (what the HF Trainer passes when a
    multi-process run resumes its optimizer state, as ``args.device``). torch
    restores each storage with ``storage.to("tpu:0")``, a storage copy a
    Python backend cannot make (the process dies with SIGSEGV); here the file is
    loaded on the host and its tensors are then copied to the device, as
    torch_tpu's C++ storages get there in one step. Tensors inside objects that
    are not containers (a pickled module) stay where the file put them; a
    ``map_location`` dict or callable naming the device is refused."""
    original = torch.load

    @functools.wraps(original)
    def load(f, map_location=None, *args, **kwargs):
        if _names_device(map_location):
            return _to_device(original(f, *args, map_location="cpu", **kwargs), torch.device(map_location))
        if isinstance(map_location, dict) and any(_names_device(v) for v in map_location.values()):
            raise NotSimulatedError(
                f"torch.load(map_location={map_location!r}): a map_location dict that sends storages to the "
                "simulated TPU device is not simulated; pass map_location='tpu:0' (or 'cpu' and move the "
                "tensors with .to(device))")
        return original(f, map_location, *args, **kwargs)

    load.__wrapped__ = original
    torch.load = load


# -- torch.accelerator: PyTorch's C entry points, answered for this device

_ACCELERATOR_ROUTES = {
    "_accelerator_synchronizeDevice": lambda index: None,
    "_accelerator_isAllocatorInitialized": lambda: True,
    "_accelerator_emptyCache": lambda: None,
    "_accelerator_emptyHostCache": lambda: None,
    "_accelerator_getDeviceStats": lambda index: memory.stats(),
    "_accelerator_resetAccumulatedStats": lambda index: memory.reset_accumulated(),
    "_accelerator_resetPeakStats": lambda index: memory.reset_peak(),
    "_accelerator_getMemoryInfo": lambda index: (max(_chip.get("total_memory", 0) - memory.current, 0),
                                                 _chip.get("total_memory", 0)),
}


def route_accelerator() -> None:
    """``torch.accelerator``'s memory and synchronize functions call these C entry
    points, which ask a C++ ``c10::DeviceAllocator`` / device guard that a backend
    written in Python cannot register (torch 2.13); in a simulated process they
    answer for the simulated device. Other accelerators never share this process."""
    for name, fn in _ACCELERATOR_ROUTES.items():
        original = getattr(torch._C, name)
        fn.__wrapped__ = original
        setattr(torch._C, name, fn)


# -- torch.compile(backend="tpu")

def _tpu_backend(gm: torch.fx.GraphModule, example_inputs):
    """The ``"tpu"`` TorchDynamo backend in simulation: the captured graph runs
    with the device's kernels (the host's, through the device tensors), as
    AOTAutograd traces it for the backward."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def run_graph(graph: torch.fx.GraphModule, _inputs):
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=run_graph, bw_compiler=run_graph)(gm, example_inputs)


def _register_tpu_backend(tensor_type: type) -> None:
    import torch._dynamo
    from torch._dynamo import list_backends, register_backend

    if DEVICE_TYPE in list_backends(exclude_tags=()):
        return
    register_backend(name=DEVICE_TYPE)(_tpu_backend)
    # TorchDynamo sees a device tensor as an object it cannot trace (not a traceable
    # wrapper subclass) and breaks the graph at each op on it; the device's own
    # Python (its __torch_dispatch__) must then run as it is, never be captured.
    dispatch = tensor_type.__dict__["__torch_dispatch__"].__func__
    tensor_type.__torch_dispatch__ = classmethod(torch._dynamo.disable(dispatch, recursive=True))


def install_compile_backend(tensor_type: type) -> None:
    """``torch.compile(..., backend="tpu")``: the backend is registered at the first
    ``torch.compile`` (importing TorchDynamo costs seconds a worker that never
    compiles should not pay). Inductor, ``torch.compile``'s default, would compile
    the device's ops for the host's kernels behind the simulated tensors: it refuses
    a graph with device inputs, naming ``backend="tpu"``.

    What the simulation cannot do: capture device ops into a graph. TorchDynamo
    traces only plain tensors and traceable wrapper subclasses; the device's
    tensors are neither, so each op on them breaks the graph and runs as in
    eager mode (results equal eager; no compile speed-up or compile time is
    simulated)."""
    original = torch.compile

    @functools.wraps(original)
    def compile(*args, **kwargs):
        _register_tpu_backend(tensor_type)
        return original(*args, **kwargs)

    compile.__wrapped__ = original
    torch.compile = compile
    inductor = torch._TorchCompileInductorWrapper
    inductor_call = inductor.__call__

    def refuse_device_graphs(self, model_, inputs_):
        if any(isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE for x in inputs_):
            raise NotSimulatedError(
                "torch.compile's default backend (inductor) cannot compile for the simulated TPU device; use "
                "torch.compile(model, backend=\"tpu\"), the backend torch_tpu registers on a TPU too "
                "(SIMULATED TPU device)")
        return inductor_call(self, model_, inputs_)

    refuse_device_graphs.__wrapped__ = inductor_call
    inductor.__call__ = refuse_device_graphs


__all__ = ["DeviceModule", "Event", "NotSimulatedError", "REFUSED", "Stream", "memory", "describe_chip",
           "torch_tpu_autocast_ops", "autocast_ops", "route_accelerator", "install_autocast",
           "install_pinned_memory", "install_load", "install_compile_backend"]
