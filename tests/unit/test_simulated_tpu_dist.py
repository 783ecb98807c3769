"""The simulated ``tpu_dist`` against torch_tpu 0.2.0's ``ProcessGroupTpu``, read in its binary.

What ``ProcessGroupTpu`` accepts and refuses is read from torch_tpu's shared
library for the installed torch (``libpywrap_<torch>_common.so``): its dynamic
symbols (``nm -DC``: which ``c10d::Backend`` methods it overrides), its strings
(its own messages, and the ones c10d's base ``Backend`` answers for methods it
does not override) and its ``getBackendName`` (the name those messages carry).
The stand-in must refuse the same calls with those messages; nothing expected
here is copied from the stand-in.
"""

import datetime
import re
import subprocess
from pathlib import Path

import pytest
import torch

from ray_train_tpu.testing import gloo as _spawn

TORCH = "_".join(torch.__version__.split("+")[0].split(".")[:3])


@pytest.fixture(scope="module")
def binary():
    # the [tpu] extra, which make test installs: never skipped. Found, not imported (importing loads
    # libtpu, and in the spawned ranks, which import this module, would take the simulated device's slot)
    import importlib.util

    spec = importlib.util.find_spec("torch_tpu")
    assert spec is not None, "torch_tpu is not installed (make setup installs the [tpu] extra)"
    lib = Path(spec.origin).parent / "csrc" / "common" / f"glue_{TORCH}" / f"libpywrap_{TORCH}_common.so"
    symbols = subprocess.run(["nm", "-DC", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    data = lib.read_bytes()
    strings = set(s.decode() for s in re.findall(rb"[\x20-\x7e]{8,}", data))
    return {"lib": lib, "defined": symbols, "strings": strings}


def _defines(binary, method: str) -> bool:
    return re.search(rf"\btorch_tpu::ProcessGroupTpu::{method}\(", binary["defined"]) is not None


def _backend_name(binary) -> str:
    """What ``ProcessGroupTpu::getBackendName`` returns: the 8-byte immediate it stores
    (``movabs $imm, %rcx``), read from its machine code."""
    lib = str(binary["lib"])
    line = next(l for l in subprocess.run(["nm", "-D", lib], capture_output=True, text=True, check=True).stdout.splitlines()
                if "ProcessGroupTpu14getBackendName" in l)
    start = int(line.split()[0], 16)
    code = subprocess.run(["objdump", "-d", f"--start-address={start:#x}", f"--stop-address={start + 64:#x}", lib],
                          capture_output=True, text=True, check=True).stdout
    imm = int(re.search(r"movabs \$0x([0-9a-f]+),", code).group(1), 16)
    length = int(re.search(r"movq\s+\$0x([0-9a-f]+),0x8\(%rdi\)", code).group(1), 16)  # the string's size
    return imm.to_bytes(8, "little")[:length].decode()


def _found(binary, fragment: str) -> str:
    """The one string of the binary that contains `fragment`."""
    hits = [s for s in binary["strings"] if fragment in s]
    assert len(hits) == 1, (fragment, hits)
    return hits[0]


def test_the_rules_read_from_torch_tpu(binary):
    """ProcessGroupTpu overrides barrier but not reduce, the coalesced collectives or the
    sequence numbers; c10d's base Backend answers those (its messages are in the binary)."""
    assert _backend_name(binary) == "tpu_dist"
    for method in ("barrier", "allreduce", "broadcast", "allgather", "_allgather_base", "reduce_scatter"):
        assert _defines(binary, method), method
    for method in ("reduce", "allreduce_coalesced", "allgather_coalesced", "getSequenceNumberForGroup",
                   "setSequenceNumberForGroup"):
        assert not _defines(binary, method), method
    for op in ("reduce", "allreduce_coalesced", "allgather_coalesced"):
        assert f" does not support {op}" in binary["strings"]


def _refusals(rank, world_size):
    import torch.distributed as dist

    import ray_train_tpu
    from ray_train_tpu._compat import torch as compat_torch

    device = ray_train_tpu.get_device()
    t = torch.ones(2, device=device)
    calls = {
        "reduce": lambda: dist.reduce(t, 0),
        "allreduce_coalesced": lambda: dist.all_reduce_coalesced([t]),
        "allgather_coalesced": lambda: dist.all_gather_coalesced([[torch.empty(2, device=device)]], [t]),
        "barrier device_ids=[1]": lambda: dist.barrier(device_ids=[1]),
        "barrier timeout": lambda: dist.barrier(timeout=datetime.timedelta(seconds=30)),
        "sequence numbers": lambda: dist.group.WORLD._get_sequence_number_for_group(),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    dist.barrier()
    dist.barrier(device_ids=[0])
    dist.all_reduce(t)
    out["allowed"] = t.cpu()
    # inside a TPUTorchTrainer worker of local rank 1: the GPU idiom means this process's device
    compat_torch.carry_barrier_device_ids(1)
    dist.barrier(device_ids=[1])
    try:
        dist.barrier(device_ids=[2])
        out["carried other"] = None
    except ValueError as e:
        out["carried other"] = str(e)
    return out


def test_the_stand_in_refuses_what_processgrouptpu_refuses_with_its_messages(binary):
    out, = _spawn.run(_refusals, 1, simulate_tpu=True)
    name = _backend_name(binary)
    for op in ("reduce", "allreduce_coalesced", "allgather_coalesced"):
        # c10d's base Backend: "Backend " + getBackendName() + the binary's string
        assert out[op].startswith(f"TpuDistUnsupportedError: Backend {name}{_found(binary, f' does not support {op}')}"), out[op]
    assert out["barrier device_ids=[1]"].startswith(
        f"TpuDistUnsupportedError: {_found(binary, 'device_ids in barrier options')}"), out["barrier device_ids=[1]"]
    assert out["barrier timeout"].startswith(
        f"TpuDistUnsupportedError: {_found(binary, 'timeout in barrier options')}"), out["barrier timeout"]
    for op in ("reduce", "barrier timeout"):
        assert "fix: " in out[op]
    assert "does not yet support sequence numbers" in out["sequence numbers"]
    assert out["allowed"].tolist() == [1.0, 1.0]
    assert "accepts only device_ids=[0]" in out["carried other"] and "[1] (LOCAL_RANK" in out["carried other"]
