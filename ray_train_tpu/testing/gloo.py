"""Run a function on a small gloo process group on CPU, one spawned process per rank.

For multi-process tests without a Ray cluster (users may import it for their
own): ``run(fn, world_size, *args)``
starts `world_size` fresh interpreters (``spawn``, never ``fork``: torch and
gloo threads do not survive a fork), rendezvouses them on 127.0.0.1 over the
loopback interface only, calls ``fn(rank, world_size, *args)`` in each and
returns every rank's result, in rank order. A failing rank's traceback is
raised in the test; the other ranks are stopped at once instead of waiting in
a collective.

With ``simulate_tpu=True`` each rank is a process of a simulated TPU host
(``RAY_TRAIN_TPU_SIMULATE=1``): ``ray_train_tpu.get_device()`` is the simulated
``tpu`` device, which refuses to mix with host tensors, and the process group is
the simulated ``tpu_dist`` (gloo underneath, for device tensors only). Results come back through ``torch.save``: return host tensors
(``.cpu()``), as a real TPU process must before its results leave it.

Example:
    >>> from ray_train_tpu.testing import gloo
    >>> results = gloo.run(my_module.train, 4, "sgd")  # doctest: +SKIP
"""

import importlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback

from ray_train_tpu import _environ
from ray_train_tpu import constants as C
from ray_train_tpu._host import free_port

_LOOPBACK = "127.0.0.1"


def _child(module: str, qualname: str, rank: int, world_size: int, port: int, args: tuple, out_dir: str,
           simulate_tpu: bool = False) -> None:
    # Before torch is imported here: no cloud metadata server queries from
    # libtpu, no torch_tpu autoload (CPU and gloo only).
    _environ.update({
        **(C.SIMULATION_ENV if simulate_tpu else C.CPU_ONLY_ENV),
        C.MASTER_ADDR: _LOOPBACK,
        C.MASTER_PORT: str(port),
        C.RANK: str(rank),
        C.WORLD_SIZE: str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",  # gloo's own connections stay on loopback too
    })
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # up to 4 ranks share 2 cores
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        backend = "gloo"
        if simulate_tpu:
            from ray_train_tpu._compat import simulated_tpu
            from ray_train_tpu.device import get_device

            get_device()  # registers the simulated device and its tpu_dist backend
            backend = simulated_tpu.TPU_DIST
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)
    # The verdict is on disk. Skip interpreter finalization: gloo's C++ worker
    # threads can still hold finished work whose tensors are freed while the
    # interpreter is torn down, and that aborts (SIGABRT, "terminate called
    # without an active exception"; pytorch/pytorch#179291 describes it) at
    # random, long after the test's assertions passed.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


class _PortTaken(RuntimeError):
    pass


def run(fn, world_size: int, *args, timeout_s: float = 90.0, attempts: int = 3, simulate_tpu: bool = False) -> list:
    """``fn(rank, world_size, *args)`` on `world_size` gloo ranks; the results in rank order.

    `fn` must be a module-level function; `args` and results must pickle
    (tensors travel through ``torch.save``). The port is probed free and then
    bound by rank 0's store a moment later; another process can take it in
    between, so that one failure is retried with a new port.
    """
    for attempt in range(attempts):
        try:
            return _run_once(fn, world_size, args, timeout_s, simulate_tpu)
        except _PortTaken:
            if attempt == attempts - 1:
                raise


def _run_once(fn, world_size: int, args: tuple, timeout_s: float, simulate_tpu: bool) -> list:
    import torch

    ctx = multiprocessing.get_context("spawn")
    port = free_port(_LOOPBACK)
    with tempfile.TemporaryDirectory(prefix="spawn-") as out_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn.__module__, fn.__qualname__, r, world_size, port, args, out_dir, simulate_tpu),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            _wait(procs, timeout_s, out_dir)
        finally:
            for p in procs:  # only the processes started here, by handle
                if p.is_alive():
                    p.kill()
                p.join(5)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def _wait(procs: list, timeout_s: float, out_dir: str) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs):
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            break  # the others would wait in a collective until their timeout
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            raise TimeoutError(f"ranks {alive} still running after {timeout_s:g} s")
        time.sleep(0.05)
    errors = []
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"--- rank {r} ---\n{f.read()}")
        elif p.exitcode not in (None, 0):
            errors.append(f"--- rank {r} --- exit code {p.exitcode}")
    if any("EADDRINUSE" in e for e in errors):
        raise _PortTaken("\n".join(errors))
    if errors:
        raise RuntimeError("spawned ranks failed:\n" + "\n".join(errors))
