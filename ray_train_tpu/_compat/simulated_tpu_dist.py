"""The simulated ``tpu_dist`` process group: gloo's connections with ``ProcessGroupTpu``'s surface.

torch_tpu 0.2.0's ``ProcessGroupTpu`` (``libpywrap_2_13_0_common.so``, read by
tests/unit/test_simulated_tpu_dist.py) is a ``c10d.Backend`` named
``"tpu_dist"`` (its ``getBackendName``) that

- refuses ``barrier`` options a GPU script often passes: ``device_ids`` other
  than ``[0]`` ("device_ids in barrier options is not supported, except
  device_ids=[0] which names this process's own device") and a ``timeout``
  ("timeout in barrier options is not supported");
- does not override ``reduce``, ``allreduce_coalesced`` or
  ``allgather_coalesced``: c10d's base ``Backend`` answers those with
  ``"Backend tpu_dist does not support <op>"``;
- has no sequence numbers (c10d asks only its built-in backend types for
  them; ``ProcessGroupTpu`` does not override ``getSequenceNumberForGroup``),
  so hang detection counts collectives itself (`ray_train_tpu.hang`).

gloo accepts all of these, so a simulation on plain gloo would pass what a
TPU refuses. The simulated device sends every collective on a device tensor
through `check` (from ``SimulatedTPUTensor.__torch_dispatch__``, the seam that
sees each ``c10d`` op with its process group and options), which refuses what
``ProcessGroupTpu`` refuses, with its message.

Where a GPU idiom has a TPU meaning, the worker's wrapper carries it over
instead (`ray_train_tpu._compat.torch.carry_barrier_device_ids`: inside a
`TPUTorchTrainer` worker ``dist.barrier(device_ids=[local_rank])`` names the
process's own device, ``[0]``), so only what has none reaches `check`.
"""

from __future__ import annotations

import functools

BACKEND_NAME = "tpu_dist"  # ProcessGroupTpu::getBackendName

# torch_tpu's own messages (its binary's strings; the test reads them there).
BARRIER_DEVICE_IDS = "device_ids in barrier options is not supported, except device_ids=[0] which names this process's own device"
BARRIER_TIMEOUT = "timeout in barrier options is not supported"
UNSET_TIMEOUT_MS = -1  # c10d's kUnsetTimeout, as the c10d::barrier op receives it

# ops ProcessGroupTpu leaves to c10d's base Backend, which refuses them
UNSUPPORTED = ("reduce", "allreduce_coalesced", "allgather_coalesced")

_FIX = {
    "barrier device_ids": "leave device_ids out (each TPU process has one device) or pass device_ids=[0]; inside a "
                          "TPUTorchTrainer worker device_ids=[local_rank] is mapped to [0] for you",
    "barrier timeout": "leave timeout out: the process group's timeout (TPUTorchConfig(timeout_s=...)) applies",
    "reduce": "all_reduce the tensor instead (every rank gets the result; use it on the root only)",
    "allreduce_coalesced": "call all_reduce once per tensor (or on one flattened tensor)",
    "allgather_coalesced": "call all_gather_into_tensor once per tensor",
}


class TpuDistUnsupportedError(RuntimeError):
    """What ``ProcessGroupTpu`` refuses, refused by the simulated ``tpu_dist``."""


def unsupported_message(op: str) -> str:
    """c10d's base-``Backend`` refusal, as ``ProcessGroupTpu`` inherits it."""
    return f"Backend {BACKEND_NAME} does not support {op}"


def _refuse(torch_tpu_message: str, rule: str):
    raise TpuDistUnsupportedError(
        f"{torch_tpu_message} (SIMULATED tpu_dist: torch_tpu 0.2.0's ProcessGroupTpu refuses this on a TPU; "
        f"fix: {_FIX[rule]})"
    )


@functools.lru_cache(maxsize=None)
def _op_name(func) -> str:
    return func._schema.name.split("::", 1)[1].rstrip("_")


def check(func, args: tuple, kwargs: dict) -> None:
    """Refuse a ``c10d`` op of a ``tpu_dist`` group that ``ProcessGroupTpu`` refuses.

    `func` is the ``c10d`` OpOverload, with its arguments as the dispatcher
    passes them (schema order)."""
    name = _op_name(func)
    if name in UNSUPPORTED:
        _refuse(unsupported_message(name), name)
    if name == "barrier":
        bound = _bind(func, args, kwargs)
        if list(bound.get("device_ids") or []) not in ([], [0]):
            _refuse(BARRIER_DEVICE_IDS, "barrier device_ids")
        if int(bound.get("timeout", UNSET_TIMEOUT_MS)) != UNSET_TIMEOUT_MS:
            _refuse(BARRIER_TIMEOUT, "barrier timeout")


def _bind(func, args: tuple, kwargs: dict) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def create_group(store, rank: int, size: int, timeout):
    """The backend behind ``tpu_dist`` in simulation: gloo's connections,
    registered for the ``tpu`` device only (torch_tpu registers its own for
    ``tpu`` only too), so a collective on a host tensor of the job's group fails
    as on a TPU. No ``_set_sequence_number_for_group``: c10d gives a custom
    backend none, as it gives ``ProcessGroupTpu`` none."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout)
