"""Per-step overhead: the same training loop under TPUTorchTrainer, Ray's TorchTrainer and torchrun.

One loop and one model (a token-wise MLP, AdamW, DDP) run with the same number of
processes and one torch thread each, launched three ways:

- ``ours``: `TPUTorchTrainer(strategy="ddp")` (on ``--device cpu``, a SIMULATED
  v4 slice: a real multi-raylet Ray cluster, CPU tensors, gloo);
- ``torch_trainer``: Ray's `ray.train.torch.TorchTrainer`, ``ScalingConfig(num_workers=N)``
  CPU workers (GPU workers on cuda), gloo (nccl);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N``.

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
baseline here). Neither was run on this machine: only cpu was.

Writes benchmarks/results/step_overhead.json (+ .png).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, ship_to_ray_workers, write  # noqa: E402  (sets TPU_SKIP_MDS_QUERY first)

NAME = "step_overhead"
LAUNCHERS = ("ours", "torch_trainer", "torchrun")
CPU_NOTE = ("CPU seconds per step (all threads, mean over ranks), ours / other: lower is better, 1.0 = no "
            "overhead. The targets are on wall-clock steps/s; this says whether a wall-clock gap is work "
            "the framework adds or time the processes waited for a core on the shared machine.")
TARGETS = {"ours_over_torchrun": 0.98, "ours_over_torch_trainer": 1.0}
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
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per GPU, for MFU (cuda)")
    p.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="RAY_worker_niceness for the Ray cluster we start (Ray's default is 15); -1 keeps Ray's")
    p.add_argument("--worker-config", help=argparse.SUPPRESS)  # internal: a torchrun child
    args = p.parse_args(argv)
    if args.worker_config:
        return args
    given = args.launchers
    if given is None:
        given = "ours" if args.device == "tpu" else ",".join(LAUNCHERS)
    launchers = [s.strip() for s in given.split(",") if s.strip()]
    bad = [s for s in launchers if s not in LAUNCHERS]
    if bad or not launchers:
        p.error(f"--launchers {given!r}: unknown {bad}; choose from {', '.join(LAUNCHERS)}")
    if args.device == "tpu" and launchers != ["ours"]:
        print(f"step_overhead: --device tpu runs 'ours' only; ignoring --launchers {given!r} "
              "(Ray's TorchTrainer cannot set up tpu_dist; torch_tpu's launcher is no baseline here)",
              file=sys.stderr)
        launchers = ["ours"]
    args.launchers = launchers
    for field in ("repeats", "steps", "batch_size", "seq_len", "dim", "hidden", "layers"):
        if getattr(args, field) < 1:
            p.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
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
    if launcher == "ours":
        import ray_train_tpu

        return ray_train_tpu.get_device(), ray_train_tpu.prepare_model
    if launcher == "torch_trainer":
        import ray.train.torch

        return ray.train.torch.get_device(), ray.train.torch.prepare_model
    from torch.nn.parallel import DistributedDataParallel

    if cfg["device"] == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
        return device, lambda m: DistributedDataParallel(m.to(device), device_ids=[device])
    dist.init_process_group("gloo")
    return torch.device("cpu"), lambda m: DistributedDataParallel(m)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_loop(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ray_train_tpu.throughput import ThroughputMeter

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

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(cfg["warmup_steps"]):
        step()
    _sync(device)
    dist.barrier()
    peak = cfg["peak_tflops"] * 1e12 if cfg.get("peak_tflops") else None
    meter = ThroughputMeter(flops_per_sample=6 * n_params * cfg["seq_len"], tokens_per_sample=cfg["seq_len"],
                            peak_flops_per_device=peak, world_size=world)
    start, cpu_start = time.perf_counter(), time.process_time()
    meter.reset()
    for _ in range(cfg["steps"]):
        loss = step()
    loss.item()  # waits for the device (cuda, tpu) to finish the last step
    _sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    # CPU seconds of every thread of every rank (gloo's and Ray's included): unlike
    # wall time, this hardly depends on what else the shared machine runs.
    cpu = torch.tensor([time.process_time() - cpu_start], device=device)
    dist.all_reduce(cpu)
    window = meter.step(cfg["batch_size"] * cfg["steps"])  # one "step" = the whole timed window
    return {
        "launcher": cfg["launcher"], "world_size": world, "steps_per_s": cfg["steps"] / elapsed,
        "cpu_ms_per_step": cpu.item() / world / cfg["steps"] * 1e3,
        "timed_s": elapsed, "tokens_per_s": window.get("tokens_per_s"), "mfu": window.get("mfu"),
        "params": n_params, "wrapper": type(model).__name__, "device": str(device),
        "torch_threads": torch.get_num_threads(), "niceness": os.nice(0), "pid": os.getpid(),
    }


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
    out = train_loop(cfg)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


# --- launchers ------------------------------------------------------------------

def run_torchrun(cfg: dict, nproc: int, timeout_s: float = 600) -> dict:
    with tempfile.TemporaryDirectory(prefix="rtt_step_") as tmp:
        out = Path(tmp) / "rank0.json"
        cfg = {**cfg, "launcher": "torchrun", "out": str(out)}
        env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
        if cfg["device"] == "cpu":
            env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo stays on loopback
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.abspath(__file__), "--worker-config", json.dumps(cfg)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def run_ray(launcher: str, cfg: dict, args, storage: str, index: int) -> dict:
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer

    cfg = {**cfg, "launcher": launcher}
    run_config = ray.train.RunConfig(name=f"{NAME}_{launcher}_{index}", storage_path=storage,
                                     failure_config=ray.train.FailureConfig(max_failures=0))
    gpu = args.device == "cuda"
    n = _num_workers(args)
    if launcher == "ours":
        scaling = (ray.train.ScalingConfig(num_workers=n, use_gpu=True) if gpu else
                   TPUScalingConfig(topology=args.topology, accelerator_type=args.accelerator_type))
        trainer = TPUTorchTrainer(_ray_loop, train_loop_config=cfg, scaling_config=scaling,
                                  run_config=run_config, strategy="ddp")
    else:
        trainer = TorchTrainer(_ray_loop, train_loop_config=cfg, run_config=run_config,
                               scaling_config=ray.train.ScalingConfig(num_workers=n, use_gpu=gpu),
                               torch_config=TorchConfig(backend="nccl" if gpu else "gloo"))
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return dict(result.metrics)


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
    set_cluster_env(args.ray_worker_niceness)
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
    return {"launchers": per, "ratios": ratios, "targets": targets,
            "cpu_per_step_ratios": cpu, "cpu_per_step_ratios_note": CPU_NOTE}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker_config:
        _torchrun_child(args.worker_config)
        return {}
    ship_to_ray_workers(sys.modules[__name__])
    cfg = {k: getattr(args, k) for k in ("device", "warmup_steps", "steps", "batch_size", "seq_len", "dim",
                                         "hidden", "layers", "peak_tflops")}
    n = _num_workers(args)
    runs, started = [], time.perf_counter()
    ray_launchers = [name for name in args.launchers if name != "torchrun"]
    with tempfile.TemporaryDirectory(prefix="rtt_step_storage_") as storage:
        with (_ray_cluster(args) if ray_launchers else contextlib.nullcontext()):
            for repeat in range(args.repeats):
                for name in rotated(args.launchers, repeat):
                    t0 = time.perf_counter()
                    run = (run_torchrun(cfg, n) if name == "torchrun"
                           else run_ray(name, cfg, args, storage, repeat))
                    run.update(repeat=repeat, wall_s=time.perf_counter() - t0)
                    runs.append(run)
                    print(f"repeat {repeat} {name:14} {run['steps_per_s']:8.2f} steps/s  "
                          f"(niceness {run['niceness']}, {run['wall_s']:.0f} s with start-up)", flush=True)
    summary = summarize(runs)
    result = {
        "question": "does the framework add per-step overhead over torchrun and Ray's TorchTrainer?",
        "environment": environment(simulated=args.device == "cpu" and bool(ray_launchers)),
        "device": args.device,
        "tested_here": args.device == "cpu",
        "note": NOTE if args.device == "cpu" else "absolute throughput on real accelerators",
        "settings": {**cfg, "num_workers": n, "repeats": args.repeats, "launchers": args.launchers,
                     "topology": args.topology if args.device != "cuda" else None,
                     "accelerator_type": args.accelerator_type if args.device != "cuda" else None,
                     "ray_worker_niceness": args.ray_worker_niceness, "torch_threads_per_process": 1},
        "runs": runs, **summary, "total_wall_s": time.perf_counter() - started,
    }
    path = write(NAME, result)
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
        print(f"  {name:14} median {s['median_steps_per_s']:8.2f}  (min {s['min_steps_per_s']:.2f}, "
              f"max {s['max_steps_per_s']:.2f})  CPU {s['median_cpu_ms_per_step'] or float('nan'):.1f} ms/step/rank{extra}")
    for key, t in result["targets"].items():
        cpu = result["cpu_per_step_ratios"].get(key)
        print(f"  {key:26} {t['measured']:.3f}  target {t['target']}: {'met' if t['met'] else 'NOT met'}"
              + (f"   (CPU per step ratio {cpu:.3f})" if cpu else ""))


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
