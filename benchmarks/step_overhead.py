"""Per-step overhead: the same training loop under TPUTorchTrainer, Ray's TorchTrainer and torchrun.

One loop and one model (a token-wise MLP, AdamW, DDP) run with the same number of
processes and one torch thread each, launched three ways, plus two experiments
that take a Ray launcher's circumstances to torchrun one at a time:

- ``ours``: `TPUTorchTrainer(strategy="ddp")` (on ``--device cpu``, a SIMULATED
  v4 slice: a real multi-raylet Ray cluster, gloo; its workers train on the host
  (``RAY_TRAIN_TPU_SIMULATE_DEVICE=host``), as the CPU baselines do, not on the
  stricter simulated "tpu" device, whose Python dispatch would be measured too);
- ``torch_trainer``: Ray's `ray.train.torch.TorchTrainer`, ``ScalingConfig(num_workers=N)``
  CPU workers (GPU workers on cuda), gloo (nccl);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N``;
- ``torchrun_beside_ray`` (cpu, asked for by name): torchrun again, while a Ray
  TorchTrainer run of N workers that does nothing is up on the same cluster, so
  Ray Train's controller, PlacementGroupCleaner, PreemptionWatcher and idle
  workers run as they do during a Ray launcher's steps. Against ``torchrun`` it
  measures what Ray Train's background costs the ranks; against ``ours`` and
  ``torch_trainer``, what is left for the launcher's own path;
- ``torchrun_in_thread`` (asked for by name): torchrun again, each rank running
  the loop in a second thread while its main thread waits, as Ray Train's
  workers do (their loop runs in a ``TrainingThread``).

Each run times ``--steps`` steps after ``--warmup-steps`` (rank 0, between two
barriers) and counts the CPU seconds all ranks spent meanwhile. Runs are
interleaved to reduce drift and rotated (A B C, B C A, C A B) so that no
launcher always runs first. The medians over ``--repeats`` give the ratios
ours/torchrun (target >= 0.98) and ours/torch_trainer (target >= 1.0) of
steps/s, and the same ratios of CPU time per step (1.0 = no added work).

Ray worker processes run at nice 15 by default (``RAY_worker_niceness``) while
torchrun's inherit ours (0); on a shared machine that alone would decide the
result, so ``--ray-worker-niceness`` (default 0) sets Ray's, and every run
records the niceness its rank 0 actually had.

``--device cuda`` (one process per GPU, nccl) also reports tokens/s and MFU
(``--peak-tflops`` per GPU); ``--device tpu`` runs ``ours`` alone on a real slice
(Ray's TorchTrainer cannot set up ``tpu_dist``; torch_tpu's launcher is not a
baseline here). cuda ran on one H200 through the device tool (one process per
launcher: results/step_overhead_cuda*.json); tpu has not run anywhere.

The steps/s and CPU ratios also come paired by repeat (the launchers of one
repeat run back to back), as a geometric mean with a 95% t-interval.

``--callgrind`` counts instructions instead (load-insensitive: this VM exposes no
hardware counters to ``perf stat``): one rank per launcher runs under valgrind's
callgrind, instrumented only for the counted steps (benchmarks/_callgrind.py), and
the JSON gets instructions per step per rank and the functions they went to.
Valgrind hides AVX-512 from the process, so MKL takes its AVX2 kernels there.
``--ddp-buckets`` runs every launcher with one DDP bucket policy (the cost of the
exact-resume default: ``fixed`` against DDP's ``rebuild``).

``--preemption-checks none,sync_every_step,guard,guard_every_10`` runs each
launcher (ours, torchrun) once per per-step preemption check, side by side in the
same rotation: ``sync_every_step`` is what ``PreemptionGuard.requested()`` did
before issue 32 (a flag all-reduced on the device, then ``.item()``: a host sync
each step), ``guard`` is today's guard (a host flag, non-blocking on a gloo group,
read one step late), ``guard_every_10`` the same with ``check_every=10``. The
JSON's ``preemption_checks`` has each one's steps/s and CPU per step, paired
against ``none``.

Writes benchmarks/results/step_overhead.json (+ .png), or
step_overhead_callgrind.json with ``--callgrind`` (``--name`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, geo_mean_ci, ship_to_ray_workers, write  # noqa: E402  (sets TPU_SKIP_MDS_QUERY first)
from benchmarks import _callgrind  # noqa: E402
from ray_train_tpu import constants as C  # noqa: E402

NAME = "step_overhead"
LAUNCHERS = ("ours", "torch_trainer", "torchrun", "torchrun_beside_ray", "torchrun_in_thread")
DEFAULT_LAUNCHERS = LAUNCHERS[:3]  # the other two are experiments, asked for by name
EXPERIMENTS = LAUNCHERS[3:]
WITHOUT_RAY = ("torchrun", "torchrun_in_thread")  # launchers that need no Ray cluster
DDP_BUCKETS = ("default", "fixed", "rebuild", "find_unused")
PREEMPTION_CHECKS = ("none", "sync_every_step", "guard", "guard_every_10")
CPU_NOTE = ("CPU seconds per step (all threads, mean over ranks), ours / other: lower is better, 1.0 = no "
            "overhead. The targets are on wall-clock steps/s; this says whether a wall-clock gap is work "
            "the framework adds or time the processes waited for a core on the shared machine.")
TARGETS = {"ours_over_torchrun": 0.98, "ours_over_torch_trainer": 1.0}
# CPU seconds per step per rank, ours / other, at most (issue 19), judged on the paired 95% interval.
CPU_TARGETS = {"ours_over_torchrun": 1.02, "ours_over_torch_trainer": 1.0}
PAIRED_NOTE = ("ours / other per repeat (the launchers of one repeat run back to back), geometric mean and 95% "
               "t-interval over repeats; an interval that contains 1.0 cannot tell the launchers apart")
NOTE = ("Absolute times on this shared 2-core machine are noise; compare the ratios, measured side by "
        "side in one run with the launchers interleaved and rotated (A B C, B C A, C A B, ...).")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda", "tpu"), default="cpu",
                   help="cpu: SIMULATED v4 slice (gloo); cuda: real GPUs (nccl); tpu: real slice (untested)")
    p.add_argument("--topology", default="2x2x1", help="slice for cpu (simulated) and tpu")
    p.add_argument("--accelerator-type", default="TPU-V4")
    p.add_argument("--num-workers", type=int, default=None, help="cuda only; default: every visible GPU")
    p.add_argument("--launchers", default=None,
                   help=f"comma-separated subset of {LAUNCHERS}; default all (on tpu: ours)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--warmup-s", type=float, default=8.0,
                   help="keep warming up (in chunks of 10 steps) until this many seconds have passed, so that "
                        "what the launcher starts beside the workers (Ray Train's PreemptionWatcher actor) "
                        "is not timed")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per GPU, for MFU (cuda)")
    p.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="RAY_worker_niceness for the Ray cluster we start (Ray's default is 15); -1 keeps Ray's")
    p.add_argument("--ddp-buckets", choices=DDP_BUCKETS, default="default",
                   help="DDP gradient buckets for every launcher: 'default' = each launcher's own (ours: fixed "
                        "order for exact resume; Ray and torchrun: DDP's rebuild after step 1); 'fixed', "
                        "'rebuild' or 'find_unused' (find_unused_parameters=True) for all")
    p.add_argument("--preemption-checks", default="none",
                   help=f"comma-separated per-step preemption checks from {PREEMPTION_CHECKS}, each run side by "
                        "side for every launcher (ours and torchrun only when other than 'none')")
    p.add_argument("--callgrind", action="store_true",
                   help="count instructions per step on one rank per launcher under valgrind's callgrind "
                        "(load-insensitive; defaults then: --steps 20 --warmup-steps 5 --repeats 1)")
    p.add_argument("--callgrind-threads", choices=_callgrind.THREAD_SCOPES, default="all",
                   help="--callgrind: count every thread of the rank ('all') or the thread that runs the "
                        "steps alone ('training'); all - training = gloo's and the launcher's threads")
    p.add_argument("--name", default=None,
                   help=f"results/<name>.json; default {NAME} ({NAME}_callgrind with --callgrind)")
    p.add_argument("--keep-callgrind", metavar="DIR", help="--callgrind: copy each counted dump here")
    p.add_argument("--pool", metavar="JSON[,JSON...]",
                   help="run nothing: pool the paired repeats of these earlier results (same loop settings, "
                        "same CPU model) into results/<name>.json (default step_overhead_pooled)")
    p.add_argument("--worker-config", help=argparse.SUPPRESS)  # internal: a torchrun child
    args = p.parse_args(argv)
    if args.worker_config:
        return args
    if args.pool is not None:
        args.pool = [s.strip() for s in args.pool.split(",") if s.strip()]
        if len(args.pool) < 2:
            p.error(f"--pool {','.join(args.pool)!r}: give two or more result files to pool")
        missing = [f for f in args.pool if not Path(f).is_file()]
        if missing:
            p.error(f"--pool: no such file {missing}")
        return args
    if args.callgrind:
        given = set(argv if argv is not None else sys.argv[1:])
        for flag, value in (("--steps", 20), ("--warmup-steps", 5), ("--repeats", 1), ("--warmup-s", 0.0)):
            if flag not in given and not any(a.startswith(flag + "=") for a in given):
                setattr(args, flag[2:].replace("-", "_"), value)
        missing = _callgrind.available()
        if missing:
            p.error(f"--callgrind: {missing}")
        if args.device != "cpu":
            p.error("--callgrind runs on --device cpu only")
    given = args.launchers
    if given is None:
        given = "ours" if args.device == "tpu" else ",".join(DEFAULT_LAUNCHERS)
    launchers = [s.strip() for s in given.split(",") if s.strip()]
    bad = [s for s in launchers if s not in LAUNCHERS]
    if bad or not launchers:
        p.error(f"--launchers {given!r}: unknown {bad}; choose from {', '.join(LAUNCHERS)}")
    if args.device == "tpu" and launchers != ["ours"]:
        print(f"step_overhead: --device tpu runs 'ours' only; ignoring --launchers {given!r} "
              "(Ray's TorchTrainer cannot set up tpu_dist; torch_tpu's launcher is no baseline here)",
              file=sys.stderr)
        launchers = ["ours"]
    for name in EXPERIMENTS:
        if args.callgrind and name in launchers:
            p.error(f"--callgrind counts one rank's instructions; {name} is a timing experiment "
                    "(its ranks are torchrun's), leave it out of --launchers")
    if "torchrun_beside_ray" in launchers and args.device != "cpu":
        p.error("--launchers torchrun_beside_ray runs on --device cpu only (the idle Ray Train run and "
                "torchrun share the simulated slice's host)")
    args.launchers = launchers
    checks = [c.strip() for c in args.preemption_checks.split(",") if c.strip()]
    if not checks or any(c not in PREEMPTION_CHECKS for c in checks) or len(set(checks)) != len(checks):
        p.error(f"--preemption-checks {args.preemption_checks!r}: give distinct checks from {PREEMPTION_CHECKS}")
    if checks != ["none"] and not set(launchers) <= {"ours", "torchrun"}:
        p.error(f"--preemption-checks {','.join(checks)} runs with --launchers ours,torchrun only (the guard "
                "needs its SIGTERM handler: TPUTorchConfig's backend installs it, torchrun's ranks here)")
    args.preemption_checks = checks
    for field in ("repeats", "steps", "batch_size", "seq_len", "dim", "hidden", "layers"):
        if getattr(args, field) < 1:
            p.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not (0 <= args.warmup_s <= 3600):
        p.error(f"--warmup-s must be between 0 and 3600, got {args.warmup_s}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    return args


# --- the training loop: identical for every launcher --------------------------

def _model(cfg):
    from torch import nn

    layers = []
    for _ in range(cfg["layers"]):
        layers += [nn.Linear(cfg["dim"], cfg["hidden"]), nn.GELU(), nn.Linear(cfg["hidden"], cfg["dim"])]
    return nn.Sequential(*layers)


def _setup(cfg):
    """(device, model wrapper) the launcher's own way; torchrun builds its process group here."""
    import torch
    import torch.distributed as dist

    launcher = cfg["launcher"]
    buckets = cfg.get("ddp_buckets", "default")
    if launcher == "ours":
        import ray_train_tpu

        return ray_train_tpu.get_device(), ray_train_tpu.prepare_model  # the trainer's DDPStrategy
    find_unused = buckets == "find_unused"
    if launcher == "torch_trainer":
        import ray.train.torch

        device = ray.train.torch.get_device()
        if buckets == "fixed":  # Ray's prepare_model builds plain DDP: wrap it the way DDPStrategy does
            from ray_train_tpu.strategies.ddp import fixed_order_ddp

            return device, lambda m: fixed_order_ddp(m.to(device))
        kwargs = {"find_unused_parameters": True} if find_unused else None
        return device, lambda m: ray.train.torch.prepare_model(m, parallel_strategy_kwargs=kwargs)
    from torch.nn.parallel import DistributedDataParallel

    from ray_train_tpu.strategies.ddp import fixed_order_ddp

    wrap = fixed_order_ddp if buckets == "fixed" else DistributedDataParallel
    kwargs = {} if buckets == "fixed" else {"find_unused_parameters": find_unused}
    # One process: no DDP, as Ray's prepare_model and our DDPStrategy do (else torchrun
    # alone would pay DDP's hooks and a one-rank all-reduce every step).
    if cfg["device"] == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
        kwargs["device_ids"] = [device]
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    if dist.get_world_size() == 1:
        return device, lambda m: m.to(device)
    return device, lambda m: wrap(m.to(device), **kwargs)


def ours_strategy(buckets: str):
    """The DDPStrategy `ours` trains with for a --ddp-buckets choice."""
    from ray_train_tpu.strategies import DDPStrategy

    if buckets == "default":
        return DDPStrategy()
    return DDPStrategy(fixed_bucket_order=buckets == "fixed", find_unused_parameters=buckets == "find_unused")


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_loop(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device, wrap = _setup(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    shape = (cfg["batch_size"], cfg["seq_len"], cfg["dim"])
    x, y = torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device)

    check, guard = preemption_check(cfg.get("preemption_check", "none"), device)

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if check() and guard is not None:
            guard.stop()  # never here: nobody sends a notice
        return loss

    with guard if guard is not None else contextlib.nullcontext():
        return _timed_loop(cfg, step, device, model, n_params, world)


def preemption_check(name: str, device):
    """(check, guard): the per-step preemption check `name` and the guard it needs."""
    import threading

    import torch
    import torch.distributed as dist

    from ray_train_tpu.checkpoint import preemption

    if name == "none":
        return (lambda: False), None
    if name == "sync_every_step":  # PreemptionGuard.requested() before issue 32, inline
        def check():
            flag = torch.tensor([0], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())
        return check, None
    if not preemption.handler_installed() and threading.current_thread() is threading.main_thread():
        preemption.install_handler()  # torchrun's ranks; TPUTorchConfig's backend does it in ours
    guard = preemption.PreemptionGuard(grace_period_s=30, check_every=10 if name == "guard_every_10" else 1)
    return guard.requested, guard


def _timed_loop(cfg, step, device, model, n_params, world) -> dict:
    import torch
    import torch.distributed as dist

    from ray_train_tpu.throughput import ThroughputMeter

    warmup_run = warm_up(step, cfg["warmup_steps"], cfg.get("warmup_s", 0.0), device)
    _sync(device)
    dist.barrier()
    peak = cfg["peak_tflops"] * 1e12 if cfg.get("peak_tflops") else None
    meter = ThroughputMeter(flops_per_sample=6 * n_params * cfg["seq_len"], tokens_per_sample=cfg["seq_len"],
                            peak_flops_per_device=peak, world_size=world)
    marker = _callgrind.Marker.from_env()  # only in the one process counted by callgrind
    rank0, rank_pids = dist.get_rank() == 0, _rank_pids()  # every rank: a collective
    others_start = processes_cpu_s() if rank0 else {}
    proc_start, machine_start, threads_start = process_counters(), machine_busy_s(), threads_cpu_s()
    start, cpu_start = time.perf_counter(), time.process_time()
    meter.reset()
    if marker:
        marker.start()
    for _ in range(cfg["steps"]):
        loss = step()
    if marker:
        marker.stop(cfg["launcher"])
    loss.item()  # waits for the device (cuda, tpu) to finish the last step
    _sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    # CPU seconds of every thread of every rank (gloo's and Ray's included): unlike
    # wall time, this hardly depends on what else the shared machine runs.
    cpu = torch.tensor([time.process_time() - cpu_start], device=device)
    dist.all_reduce(cpu)
    machine = machine_busy_s() - machine_start if machine_start is not None else None
    busiest_others = busiest_processes(others_start, processes_cpu_s(), cfg["steps"], rank_pids) if rank0 else []
    end_counters = process_counters()
    proc = {k: v - proc_start.get(k, 0) for k, v in end_counters.items() if k not in ("threads", "rss_kib")}
    threads = per_thread_ms(threads_start, threads_cpu_s(), cfg["steps"])
    window = meter.step(cfg["batch_size"] * cfg["steps"])  # one "step" = the whole timed window
    return {
        "launcher": cfg["launcher"], "preemption_check": cfg.get("preemption_check", "none"),
        "world_size": world, "steps_per_s": cfg["steps"] / elapsed,
        "cpu_ms_per_step": cpu.item() / world / cfg["steps"] * 1e3,
        "timed_s": elapsed, "tokens_per_s": window.get("tokens_per_s"), "mfu": window.get("mfu"),
        "params": n_params, "wrapper": type(model).__name__, "device": str(device),
        "warmup_steps_run": warmup_run,
        "torch_threads": torch.get_num_threads(), "niceness": os.nice(0), "pid": os.getpid(),
        # Where a wall-clock gap with equal CPU per step comes from: what else ran
        # on the machine meanwhile (all cores, minus the ranks), and rank 0's threads,
        # cores it may use and context switches per step (involuntary: preempted).
        "other_cpu_ms_per_step": (None if machine is None else
                                  max(0.0, machine - cpu.item()) / cfg["steps"] * 1e3),
        "busiest_other_processes": busiest_others,
        # This rank's CPU per step by OS thread name (user, system): the training
        # thread, gloo's, and the launcher's own threads (Ray's core worker, gRPC).
        "thread_cpu_ms_per_step": threads,
        "threads": end_counters.get("threads"), "rss_mib": end_counters.get("rss_kib", 0) / 1024,
        "minor_faults_per_step": proc.get("minor_faults", 0) / cfg["steps"],
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "voluntary_switches_per_step": proc.get("voluntary_ctxt_switches", 0) / cfg["steps"],
        "involuntary_switches_per_step": proc.get("nonvoluntary_ctxt_switches", 0) / cfg["steps"],
    }


def processes_cpu_s() -> dict:
    """CPU seconds (user + system) of every process on the machine, by pid, with its command."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        out[int(entry.name)] = ((int(fields[11]) + int(fields[12])) / tick, cmd)  # utime, stime
    return out


def busiest_processes(before: dict, after: dict, steps: int, exclude: set, n: int = 8) -> list[dict]:
    """The `n` processes not in `exclude` (the job's ranks) that used the most CPU
    between two `processes_cpu_s` snapshots, in ms per step (Ray names a worker
    process by what it runs: ``ray::RayTrainWorker`` etc.)."""
    rows = []
    for pid, (cpu, cmd) in after.items():
        if pid in exclude:
            continue
        used = cpu - before.get(pid, (0.0, cmd))[0]
        if used > 0:
            rows.append({"pid": pid, "command": cmd[:160], "ms_per_step": used / steps * 1e3})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def _rank_pids() -> set:
    """The pids of every rank (this job's process group): gathered from all ranks."""
    import torch.distributed as dist

    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return set(pids)


def threads_cpu_s() -> dict:
    """(name, user s, system s) of every thread of this process, by thread id (``/proc/self/task``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                head, _, tail = fh.read().rpartition(")")
            fields = tail.split()
            out[int(tid)] = (head.split("(", 1)[1], int(fields[11]) / tick, int(fields[12]) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


def per_thread_ms(before: dict, after: dict, steps: int) -> dict:
    """CPU ms per step (user, system) between two `threads_cpu_s` snapshots,
    summed by thread name, busiest first; threads that used none are left out."""
    by_name: dict = {}
    for tid, (name, user, system) in after.items():
        _, user0, system0 = before.get(tid, (name, 0.0, 0.0))
        row = by_name.setdefault(name, [0.0, 0.0])
        row[0] += user - user0
        row[1] += system - system0
    rows = {name: {"user": u / steps * 1e3, "system": s / steps * 1e3} for name, (u, s) in by_name.items() if u + s > 0}
    return dict(sorted(rows.items(), key=lambda kv: -(kv[1]["user"] + kv[1]["system"])))


def process_counters() -> dict:
    """This process's thread count, context switches and resident memory
    (``/proc/self/status``) and page faults (``/proc/self/stat``)."""
    out = {}
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        out["minor_faults"], out["major_faults"] = int(fields[7]), int(fields[9])
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("Threads", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "VmRSS"):
                    out[{"Threads": "threads", "VmRSS": "rss_kib"}.get(key, key)] = int(value.split()[0])
    except OSError:
        pass
    return out


def machine_busy_s() -> Optional[float]:
    """CPU seconds every core of the machine has been busy since boot (``/proc/stat``), or None."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def warm_up(step, steps: int, seconds: float, device, chunk: int = 10) -> int:
    """Run `steps` steps, then more in chunks of `chunk` until `seconds` have
    passed since the first (rank 0's clock decides, so every rank runs the same
    number). What a launcher starts beside the workers settles meanwhile: Ray
    Train starts its PreemptionWatcher actor as the worker group starts, ~1.2 s
    of CPU that would otherwise land in the timed window. Returns the steps run."""
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    for _ in range(steps):
        step()
    done = steps
    while True:
        flag = torch.tensor([1 if time.perf_counter() - start < seconds else 0], device=device)
        dist.broadcast(flag, src=0)
        if not flag.item():
            return done
        for _ in range(chunk):
            step()
        done += chunk


def _ray_loop(cfg):
    import ray.train

    report_from_rank0(train_loop(cfg))


def report_from_rank0(metrics: dict) -> None:
    """``ray.train.report`` on every rank (it is a barrier); Ray Train v2 keeps only
    metrics that come with a checkpoint, so rank 0 attaches a one-file one."""
    import ray.train

    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "metrics.json").write_text(json.dumps(metrics))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _torchrun_child(cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    out = in_thread(train_loop, cfg) if cfg.get("train_in_thread") else train_loop(cfg)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def in_thread(fn, *args):
    """``fn(*args)`` in a new thread while this one waits, as Ray Train's workers run
    their loop; returns its result or raises its exception."""
    import threading

    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
            outcome["error"] = e

    thread = threading.Thread(target=target, name="TrainingThread")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# --- launchers ------------------------------------------------------------------

def run_torchrun(cfg: dict, nproc: int, timeout_s: float = 600, callgrind_dir: Optional[str] = None,
                 callgrind_threads: str = "all", train_in_thread: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="rtt_step_") as tmp:
        out = Path(tmp) / "rank0.json"
        cfg = {**cfg, "launcher": "torchrun_in_thread" if train_in_thread else "torchrun", "out": str(out),
               "train_in_thread": train_in_thread}
        env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
        if cfg["device"] == "cpu":
            env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo stays on loopback
        entry = []
        if callgrind_dir:  # rank 0 runs under callgrind, through a python stand-in
            entry = ["--no-python", str(_callgrind.write_wrapper(Path(tmp) / "python.sh", sys.executable,
                                                                  callgrind_dir, rank_env="RANK",
                                                                  threads=callgrind_threads))]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *entry, os.path.abspath(__file__), "--worker-config", json.dumps(cfg)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def run_ray(launcher: str, cfg: dict, args, storage: str, index: int, callgrind_dir: Optional[str] = None) -> dict:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer

    cfg = {**cfg, "launcher": launcher}
    worker_env = {}
    if args.device == "cpu":
        # Like with like: the CPU baselines (torchrun, TorchTrainer) train on the host, so the
        # SIMULATED slice's workers do too, not on the stricter simulated "tpu" device.
        worker_env["env_vars"] = {C.RAY_TRAIN_TPU_SIMULATE_DEVICE: "host"}
    if callgrind_dir:  # the first train worker to start runs under callgrind
        wrapper = _callgrind.write_wrapper(Path(callgrind_dir) / "python.sh", sys.executable, callgrind_dir,
                                           rank_env=None, threads=args.callgrind_threads)
        worker_env["py_executable"] = str(wrapper)
    run_config = ray.train.RunConfig(name=f"{NAME}_{launcher}_{index}", storage_path=storage,
                                     failure_config=ray.train.FailureConfig(max_failures=0),
                                     worker_runtime_env=worker_env or None)
    gpu = args.device == "cuda"
    n = _num_workers(args)
    if launcher == "ours":
        scaling = (ray.train.ScalingConfig(num_workers=n, use_gpu=True) if gpu else
                   TPUScalingConfig(topology=args.topology, accelerator_type=args.accelerator_type))
        torch_config = None
        if callgrind_dir:  # the counted worker starts slowly under valgrind
            from ray_train_tpu import TPUTorchConfig

            torch_config = TPUTorchConfig(rendezvous_timeout_s=900)
        trainer = TPUTorchTrainer(_ray_loop, train_loop_config=cfg, scaling_config=scaling,
                                  run_config=run_config, torch_config=torch_config,
                                  strategy=ours_strategy(cfg.get("ddp_buckets", "default")))
    else:
        trainer = TorchTrainer(_ray_loop, train_loop_config=cfg, run_config=run_config,
                               scaling_config=ray.train.ScalingConfig(num_workers=n, use_gpu=gpu),
                               torch_config=TorchConfig(backend="nccl" if gpu else "gloo"))
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return dict(result.metrics)


def _idle_loop(cfg: dict) -> None:
    """A Ray Train loop that does nothing: rank 0 says it is up, then every rank
    waits (a stat per second) for the driver's stop file."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:  # written whole, then renamed: seen complete or not at all
        Path(cfg["ready"] + ".part").write_text("up")
        os.replace(cfg["ready"] + ".part", cfg["ready"])
    while not Path(cfg["stop"]).exists():
        time.sleep(1.0)


@contextlib.contextmanager
def ray_train_running_idle(make_trainer, timeout_s: float = 300):
    """Run ``make_trainer(loop, cfg).fit()`` in a background thread with `_idle_loop`
    and yield once its workers are up; on exit, stop it and wait for it to end.
    Raises if the run fails or is not up within `timeout_s`."""
    import threading

    tmp = Path(tempfile.mkdtemp(prefix="rtt_idle_"))
    cfg = {"ready": str(tmp / "ready"), "stop": str(tmp / "stop")}
    outcome: dict = {}

    def fit():
        try:
            result = make_trainer(_idle_loop, cfg).fit()
            outcome["error"] = getattr(result, "error", None)
        except BaseException as e:  # noqa: BLE001  (reported in the driver thread)
            outcome["error"] = e

    thread = threading.Thread(target=fit, name="idle-ray-train-run", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not Path(cfg["ready"]).exists():
            if not thread.is_alive():
                raise RuntimeError(f"the idle Ray Train run ended before its workers were up: "
                                   f"{outcome.get('error')!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the idle Ray Train run's workers were not up within {timeout_s:.0f} s")
            time.sleep(0.2)
        yield
    finally:
        Path(cfg["stop"]).write_text("stop")
        thread.join(timeout_s)
        shutil.rmtree(tmp, ignore_errors=True)
    if thread.is_alive():
        raise TimeoutError(f"the idle Ray Train run did not stop within {timeout_s:.0f} s")
    if outcome.get("error") is not None:
        raise RuntimeError(f"the idle Ray Train run failed: {outcome['error']!r}")


def run_torchrun_beside_ray(cfg: dict, n: int, storage: str, index: int) -> dict:
    """torchrun's run while an idle TorchTrainer run of `n` workers is up."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    def make_trainer(loop, loop_cfg):
        return TorchTrainer(loop, train_loop_config=loop_cfg, torch_config=TorchConfig(backend="gloo"),
                            scaling_config=ray.train.ScalingConfig(num_workers=n),
                            run_config=ray.train.RunConfig(name=f"{NAME}_idle_{index}", storage_path=storage,
                                                           failure_config=ray.train.FailureConfig(max_failures=0)))

    with ray_train_running_idle(make_trainer):
        run = run_torchrun(cfg, n)
    run["launcher"] = "torchrun_beside_ray"
    return run


def _num_workers(args) -> int:
    if args.device == "cuda":
        if args.num_workers:
            return args.num_workers
        import torch

        return torch.cuda.device_count()
    from ray_train_tpu.topology import Topology

    return Topology.parse(args.topology, args.accelerator_type).num_devices


def set_cluster_env(ray_worker_niceness: int, **extra: str) -> None:
    """Variables for every raylet and worker of the Ray cluster this process is
    about to start (they inherit our environment): ``RAY_worker_niceness`` unless
    negative (Ray's default, 15, is kept), and `extra`. Call before the cluster starts."""
    if ray_worker_niceness >= 0:
        extra = {"RAY_worker_niceness": str(ray_worker_niceness), **extra}
    os.environ.update(extra)


def _ray_cluster(args):
    """The cluster the Ray launchers use: a simulated slice on cpu, else the local/attached one."""
    slow_start = {}
    if args.callgrind:  # a worker under valgrind takes minutes to register and start
        slow_start = {"RAY_worker_register_timeout_seconds": "900",
                      "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "900"}
    set_cluster_env(args.ray_worker_niceness, **slow_start)
    if args.device == "cpu":
        from ray_train_tpu.testing import simulated_tpu_cluster

        return simulated_tpu_cluster(args.topology, args.accelerator_type)

    @contextlib.contextmanager
    def attached():
        import ray

        ray.init(address="auto" if args.device == "tpu" else None)
        try:
            yield None
        finally:
            ray.shutdown()

    return attached()


def rotated(launchers: list, repeat: int) -> list:
    """Repeat r starts with launcher r (A B C, B C A, C A B, ...): each takes every
    position equally often, so what follows a fresh cluster or another launcher's
    teardown does not always hit the same one."""
    k = repeat % len(launchers)
    return list(launchers[k:]) + list(launchers[:k])


# --- summary --------------------------------------------------------------------

def callgrind_result(dump, steps: int) -> dict:
    """Instructions per step of the counted rank (all its threads, or its training
    thread alone) and the libraries and functions they went to."""
    counts = _callgrind.read_counts(dump)
    return {**counts, "instructions_per_step": counts["instructions"] / steps,
            "by_library_per_step": {k: v / steps for k, v in _callgrind.by_library(dump).items()},
            "top_functions_self": _callgrind.top_functions(dump)}


def summarize_callgrind(runs: list[dict], threads: str = "all") -> dict:
    """Median instructions per step per launcher (one counted rank per run) and
    the ratios ours / other (1.0 = no added work; lower is better)."""
    per = {}
    for name in LAUNCHERS:
        mine = [r["callgrind"] for r in runs if r["launcher"] == name and r.get("callgrind")]
        if mine:
            values = [c["instructions_per_step"] for c in mine]
            per[name] = {"instructions_per_step": statistics.median(values), "each_run": values}
    ratios = {}
    for other in ("torchrun", "torch_trainer"):
        if "ours" in per and other in per:
            ratios[f"ours_over_{other}"] = per["ours"]["instructions_per_step"] / per[other]["instructions_per_step"]
    return {"threads": threads, "launchers": per, "ratios": ratios, "note": CALLGRIND_NOTES[threads]}


CALLGRIND_NOTES = {
    "all": ("valgrind callgrind on one rank, every thread of it: instructions from the first to the last counted "
            "step (the training thread, gloo's transport thread and the launcher's threads: Ray's core worker "
            "and gRPC threads do work per second, not per step, and callgrind slows the process ~50x, so their "
            "share is ~50x what it is in a real run)"),
    "training": ("valgrind callgrind on one rank, the thread that runs the training steps alone "
                 "(--separate-threads=yes): the per-step work of the loop, DDP and the optimizer, without "
                 "gloo's transport thread and the launcher's threads"),
}


def summarize(runs: list[dict]) -> dict:
    """Medians per launcher, ratios and targets from the individual runs."""
    per = {}
    for name in LAUNCHERS:
        rates = [r["steps_per_s"] for r in runs if r["launcher"] == name]
        if not rates:
            continue
        mine = [r for r in runs if r["launcher"] == name]
        per[name] = {"median_steps_per_s": statistics.median(rates), "min_steps_per_s": min(rates),
                     "max_steps_per_s": max(rates), "steps_per_s": rates,
                     "median_cpu_ms_per_step": _median([r.get("cpu_ms_per_step") for r in mine]),
                     "median_other_cpu_ms_per_step": _median([r.get("other_cpu_ms_per_step") for r in mine]),
                     "median_involuntary_switches_per_step": _median(
                         [r.get("involuntary_switches_per_step") for r in mine]),
                     "median_tokens_per_s": _median([r.get("tokens_per_s") for r in mine]),
                     "median_mfu": _median([r.get("mfu") for r in mine])}
    ratios, targets, cpu = {}, {}, {}
    for key, target in TARGETS.items():
        other = key.split("_over_", 1)[1]
        if "ours" in per and other in per:
            ratios[key] = per["ours"]["median_steps_per_s"] / per[other]["median_steps_per_s"]
            targets[key] = {"target": f">= {target}", "measured": ratios[key], "met": ratios[key] >= target}
            if per["ours"]["median_cpu_ms_per_step"] and per[other]["median_cpu_ms_per_step"]:
                cpu[key] = per["ours"]["median_cpu_ms_per_step"] / per[other]["median_cpu_ms_per_step"]
    paired = {}
    # torch_trainer / torchrun: the part of a gap that any Ray Train run has (reference, no target);
    # experiment / torchrun: what one circumstance of a Ray worker costs torchrun's ranks, and
    # ours (torch_trainer) / experiment: what is left once torchrun has it too
    pairs = [("ours", "torchrun"), ("ours", "torch_trainer"), ("torch_trainer", "torchrun")]
    pairs += [pair for e in EXPERIMENTS for pair in ((e, "torchrun"), ("ours", e), ("torch_trainer", e))]
    for a, b in pairs:
        for metric in ("steps_per_s", "cpu_ms_per_step", "other_cpu_ms_per_step"):
            ci = paired_ratio_ci(runs, a, b, metric)
            if ci:
                paired.setdefault(f"{a}_over_{b}", {})[metric] = ci
    cpu_targets = {key: cpu_verdict(paired.get(key, {}).get("cpu_ms_per_step"), limit)
                   for key, limit in CPU_TARGETS.items() if paired.get(key, {}).get("cpu_ms_per_step")}
    return {"launchers": per, "ratios": ratios, "targets": targets, "cpu_targets": cpu_targets,
            "cpu_per_step_ratios": cpu, "cpu_per_step_ratios_note": CPU_NOTE,
            "paired_ratios": paired, "paired_ratios_note": PAIRED_NOTE}


def summarize_preemption_checks(runs: list[dict], checks: list[str]) -> dict:
    """Per launcher and check: median steps/s and CPU ms per step, and each check
    paired against the first (``none``) by repeat."""
    out = {}
    for launcher in sorted({r["launcher"] for r in runs}):
        mine = [dict(r, launcher=r["preemption_check"]) for r in runs if r["launcher"] == launcher]
        per = {}
        for check in checks:
            of = [r for r in mine if r["launcher"] == check]
            per[check] = {"median_steps_per_s": _median([r["steps_per_s"] for r in of]),
                          "median_cpu_ms_per_step": _median([r.get("cpu_ms_per_step") for r in of]),
                          "paired_over_" + checks[0]: {
                              metric: paired_ratio_ci(mine, check, checks[0], metric)
                              for metric in ("steps_per_s", "cpu_ms_per_step")} if check != checks[0] else None}
        out[launcher] = per
    return out


def cpu_verdict(ci: dict, limit: float) -> dict:
    """A CPU-per-step target (ratio <= `limit`) judged on a paired interval: met when
    the whole interval is at or below it, missed when the whole interval is above,
    else undecided (more repeats needed)."""
    low, high = ci["ci95"]
    verdict = "met" if high <= limit else "missed" if low > limit else "undecided"
    return {"target": f"<= {limit}", "ratio": ci["ratio"], "ci95": ci["ci95"], "verdict": verdict}


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then ~normal).


def paired_ratio_ci(runs: list[dict], a: str, b: str, key: str) -> Optional[dict]:
    """Ratio a/b of `key`, paired by repeat (both ran in the same rotation, minutes
    apart): geometric mean of the per-repeat ratios and its 95% t-interval, on
    logs. None with fewer than two pairs."""
    by = {}
    for r in runs:
        if r.get(key):
            by.setdefault(r.get("repeat"), {})[r["launcher"]] = r[key]
    found = geo_mean_ci([v[a] / v[b] for v in by.values() if a in v and b in v])
    if found is None:
        return None
    return {"ratio": found["ratio"], "ci95": found["ci95"], "pairs": found["pairs"], "per_repeat": found["per_pair"]}


# What must match for repeats of different runs to be pooled: the loop, the
# processes and the cluster's niceness; the launchers and repeat counts may differ.
POOL_SETTINGS = ("device", "warmup_steps", "warmup_s", "steps", "batch_size", "seq_len", "dim", "hidden",
                 "layers", "ddp_buckets", "num_workers", "ray_worker_niceness", "torch_threads_per_process",
                 "callgrind")


def pool_results(results: list[dict], sources: list[str]) -> dict:
    """One result from the runs of several: each run's repeats stay paired with
    their own run's (repeat keys become "<source index>:<repeat>"), and
    `summarize` sees them all. Raises ValueError if the loop settings or the
    CPU model differ, since those change the ratios."""
    first = results[0]
    for src, res in zip(sources[1:], results[1:]):
        differ = {k: (first["settings"].get(k), res["settings"].get(k)) for k in POOL_SETTINGS
                  if first["settings"].get(k) != res["settings"].get(k)}
        if differ:
            raise ValueError(f"--pool: {src} was run with other settings than {sources[0]} "
                             f"({', '.join(f'{k}: {a!r} vs {b!r}' for k, (a, b) in differ.items())}); "
                             "pool only runs of the same loop")
        models = (first["environment"].get("cpu", {}).get("model"), res["environment"].get("cpu", {}).get("model"))
        if models[0] != models[1]:
            raise ValueError(f"--pool: {src} ran on {models[1]!r}, {sources[0]} on {models[0]!r}; "
                             "results differ by CPU, pool only runs of one CPU model")
    runs = [{**r, "repeat": f"{i}:{r['repeat']}"} for i, res in enumerate(results) for r in res["runs"]]
    launchers = list(dict.fromkeys(name for res in results for name in res["settings"]["launchers"]))
    return {
        "question": first["question"],
        "pooled_from": [{"file": src, "commit": res["environment"].get("commit"),
                         "repeats": res["settings"]["repeats"], "launchers": res["settings"]["launchers"]}
                        for src, res in zip(sources, results)],
        "environment": first["environment"], "device": first["device"], "tested_here": first["tested_here"],
        "note": first["note"] + " Pooled: each run's repeats are paired within that run only.",
        "settings": {**{k: first["settings"].get(k) for k in POOL_SETTINGS},
                     "repeats": sum(res["settings"]["repeats"] for res in results), "launchers": launchers},
        "runs": runs, **summarize(runs),
        # The runs went at different absolute speeds (another day, another load): medians over
        # all of them mix those levels, so only the paired ratios are kept.
        "ratios": {}, "targets": {}, "cpu_per_step_ratios": {},
        "unpaired_note": "pooled runs: the per-launcher medians mix runs of different absolute speed; "
                         "compare the paired ratios only",
    }


def _num(value) -> float:
    return float("nan") if value is None else value


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker_config:
        _torchrun_child(args.worker_config)
        return {}
    if args.pool:
        result = pool_results([json.loads(Path(f).read_text()) for f in args.pool], args.pool)
        path = write(args.name or f"{NAME}_pooled", result)
        _print_table(result)
        print(f"wrote {path}")
        return result
    ship_to_ray_workers(sys.modules[__name__], _callgrind)
    cfg = {k: getattr(args, k) for k in ("device", "warmup_steps", "warmup_s", "steps", "batch_size", "seq_len", "dim",
                                         "hidden", "layers", "peak_tflops", "ddp_buckets", "preemption_checks")}
    n = _num_workers(args)
    runs, started = [], time.perf_counter()
    ray_launchers = [name for name in args.launchers if name not in WITHOUT_RAY]
    with tempfile.TemporaryDirectory(prefix="rtt_step_storage_") as storage:
        with (_ray_cluster(args) if ray_launchers else contextlib.nullcontext()):
            variants = [(name, check) for name in args.launchers for check in args.preemption_checks]
            for repeat in range(args.repeats):
                for name, check in rotated(variants, repeat):
                    cfg["preemption_check"] = check
                    t0 = time.perf_counter()
                    with (tempfile.TemporaryDirectory(prefix="rtt_cg_") if args.callgrind
                          else contextlib.nullcontext()) as cg_dir:
                        if name == "torchrun":
                            run = run_torchrun(cfg, n, timeout_s=1800 if cg_dir else 600, callgrind_dir=cg_dir,
                                               callgrind_threads=args.callgrind_threads)
                        elif name == "torchrun_in_thread":
                            run = run_torchrun(cfg, n, train_in_thread=True)
                        elif name == "torchrun_beside_ray":
                            run = run_torchrun_beside_ray(cfg, n, storage, repeat)
                        else:
                            run = run_ray(name, cfg, args, storage, repeat, cg_dir)
                        if cg_dir:
                            dump = _callgrind.find_dump(cg_dir, name)
                            run["callgrind"] = callgrind_result(dump, args.steps)
                            if args.keep_callgrind:
                                Path(args.keep_callgrind).mkdir(parents=True, exist_ok=True)
                                kept = Path(args.keep_callgrind) / f"callgrind.{name}.{args.callgrind_threads}.{repeat}.out"
                                shutil.copy(dump, kept)
                                run["callgrind"]["dump"] = str(kept)
                    run.update(repeat=repeat, wall_s=time.perf_counter() - t0)
                    runs.append(run)
                    cg = run.get("callgrind")
                    label = name if args.preemption_checks == ["none"] else f"{name}/{check}"
                    print(f"repeat {repeat} {label:20} {run['steps_per_s']:8.2f} steps/s  "
                          f"(niceness {run['niceness']}, {run['wall_s']:.0f} s with start-up)"
                          + (f"  {cg['instructions_per_step'] / 1e6:.2f} M instructions/step/rank "
                             f"({'every thread' if args.callgrind_threads == 'all' else 'training thread'})" if cg else ""),
                          flush=True)
    cfg.pop("preemption_check", None)
    summary = summarize([r for r in runs if r.get("preemption_check", "none") == args.preemption_checks[0]])
    if args.preemption_checks != ["none"]:
        summary["preemption_checks"] = summarize_preemption_checks(runs, args.preemption_checks)
    result = {
        "question": "does the framework add per-step overhead over torchrun and Ray's TorchTrainer?",
        "environment": environment(simulated=args.device == "cpu" and bool(ray_launchers)),
        "device": args.device,
        "tested_here": args.device == "cpu",
        "note": NOTE if args.device == "cpu" else "absolute throughput on real accelerators",
        "settings": {**cfg, "num_workers": n, "repeats": args.repeats, "launchers": args.launchers,
                     "callgrind": args.callgrind,
                     "topology": args.topology if args.device != "cuda" else None,
                     "accelerator_type": args.accelerator_type if args.device != "cuda" else None,
                     "ray_worker_niceness": args.ray_worker_niceness, "torch_threads_per_process": 1},
        "runs": runs, **summary, "total_wall_s": time.perf_counter() - started,
    }
    if args.callgrind:
        result["callgrind"] = summarize_callgrind(runs, args.callgrind_threads)
        result["note"] = ("--callgrind: steps/s and CPU times are of a run with one rank under valgrind; "
                          "only the instruction counts mean anything")
    default_name = NAME
    if args.callgrind:
        default_name += "_callgrind" + ("_training_thread" if args.callgrind_threads == "training" else "")
    path = write(args.name or default_name, result)
    _print_table(result)
    _plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return result


def _print_table(result):
    sim = " [SIMULATED slice, CPU, gloo]" if result["environment"]["simulated"] else ""
    print(f"\nsteps/s over {result['settings']['repeats']} interleaved repeats, "
          f"{result['settings']['num_workers']} processes{sim}")
    for name, s in result["launchers"].items():
        extra = f"  {s['median_tokens_per_s']:.0f} tokens/s" if s["median_tokens_per_s"] else ""
        if s["median_mfu"]:
            extra += f"  MFU {s['median_mfu']:.1%}"
        print(f"  {name:20} median {s['median_steps_per_s']:8.2f}  (min {s['min_steps_per_s']:.2f}, "
              f"max {s['max_steps_per_s']:.2f})  CPU {s['median_cpu_ms_per_step'] or float('nan'):.1f} ms/step/rank, "
              f"others {_num(s.get('median_other_cpu_ms_per_step')):.1f} ms/step{extra}")
    if result.get("unpaired_note"):
        print(f"  ({result['unpaired_note']})")
    references = [(k, None) for k in result.get("paired_ratios", {}) if k not in result["targets"]]
    for key, t in list(result["targets"].items()) + references:
        if t is None:
            if key in result.get("paired_ratios", {}):
                label = "(paired only)" if key in result.get("cpu_targets", {}) else "(reference, no target)"
                print(f"  {key:38} {label}")
                for metric, ci in result["paired_ratios"][key].items():
                    print(f"    paired {metric:16} {ci['ratio']:.3f}  95% CI [{ci['ci95'][0]:.3f}, {ci['ci95'][1]:.3f}]")
                verdict = result.get("cpu_targets", {}).get(key)
                if verdict:
                    print(f"    CPU per step target {verdict['target']}: {verdict['verdict']}")
            continue
        cpu = result["cpu_per_step_ratios"].get(key)
        print(f"  {key:38} {t['measured']:.3f}  target {t['target']}: {'met' if t['met'] else 'NOT met'}"
              + (f"   (CPU per step ratio {cpu:.3f})" if cpu else ""))
        for metric, ci in result.get("paired_ratios", {}).get(key, {}).items():
            print(f"    paired {metric:16} {ci['ratio']:.3f}  95% CI [{ci['ci95'][0]:.3f}, {ci['ci95'][1]:.3f}] "
                  f"over {ci['pairs']} repeats")
        verdict = result.get("cpu_targets", {}).get(key)
        if verdict:
            print(f"    CPU per step target {verdict['target']}: {verdict['verdict']}")
    for launcher, per in result.get("preemption_checks", {}).items():
        print(f"  preemption checks under {launcher}:")
        for check, st in per.items():
            paired = next((v for k, v in st.items() if k.startswith("paired_over_") and v), {})
            ratio = paired.get("steps_per_s")
            print(f"    {check:16} median {_num(st['median_steps_per_s']):8.2f} steps/s  CPU "
                  f"{_num(st['median_cpu_ms_per_step']):.2f} ms/step/rank"
                  + (f"  steps/s vs none {ratio['ratio']:.3f} 95% CI [{ratio['ci95'][0]:.3f}, "
                     f"{ratio['ci95'][1]:.3f}]" if ratio else ""))
    cg = result.get("callgrind", {})
    for key, ratio in cg.get("ratios", {}).items():
        print(f"  callgrind instructions per step {key} ({cg['threads']} threads): {ratio:.3f}")


def _plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(result["launchers"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, label in ((axes[0], "steps_per_s", "steps/s (wall clock)"),
                           (axes[1], "cpu_ms_per_step", "CPU ms per step per rank")):
        for i, name in enumerate(names):
            values = [r[key] for r in result["runs"] if r["launcher"] == name and r.get(key)]
            if values:
                ax.bar(i, sorted(values)[len(values) // 2], color=f"C{i}", alpha=0.6)
                ax.plot([i] * len(values), values, "k.", label="each repeat" if i == 0 else None)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(f"{label}: median, dots: repeats", fontsize=8)
        ax.legend(fontsize=8)
    ratios = ", ".join(f"{k.replace('_over_', '/')} {v:.3f}" for k, v in result["ratios"].items())
    sim = "SIMULATED slice, " if result["environment"]["simulated"] else ""
    fig.suptitle(f"same DDP loop, {result['settings']['num_workers']} processes ({sim}{result['device']}); "
                 f"steps/s {ratios}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
