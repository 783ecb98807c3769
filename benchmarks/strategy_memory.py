"""Per-rank memory of each strategy: parameters, gradients, AdamW state and peak RSS.

The same MLP (``--blocks`` x [Linear(dim, hidden), ReLU, Linear(hidden, dim)],
~16.8 M parameters by default) is trained for a few AdamW steps under
`TPUTorchTrainer` with ``ddp``, ``fsdp2``, ``tp`` (tensor parallel over all 4
ranks) and ``fsdp2+tp`` (tp 2 x FSDP 2), on 4 workers of a SIMULATED v4 2x2x1
slice. After the last step (gradients kept) every rank counts the bytes it
holds: for a DTensor, its local shard (``p.to_local()``), for gradients and
optimizer state alike; the chip's own memory statistics
(`ray_train_tpu.device.accelerator_memory`: ``torch.accelerator.memory_allocated``
and ``max_memory_allocated``, HBM on a TPU, the bytes of live device tensors on
the simulated slice), which need no counting code and also see what the counts
miss (FSDP2's all-gathered parameters at the peak, DDP's gradient buckets); and
its peak RSS (``resource.getrusage``), also as the growth over the peak before
the model was built.

Target: FSDP2 per-rank state (parameters + gradients + optimizer state) <=
1.1 x (DDP's / world size).

Counted bytes are exact and do not depend on the machine; RSS does: it includes
the full model that every rank builds before sharding, FSDP2's all-gathered
parameters, activations, and DDP's gradient buckets (a second copy of the
gradients, not counted in ``p.grad``). glibc keeps freed blocks below its
(dynamic) mmap threshold in the heap, and FSDP2 frees and reallocates its
unsharded parameters and gradients at every layer: with glibc's default, its
peak RSS grew as much as DDP's while holding a quarter of the state. So the
workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (``--malloc-mmap-threshold``;
0 keeps glibc's default), which returns large freed blocks to the OS at once
and makes RSS follow live memory.

Writes benchmarks/results/strategy_memory.json (+ .png).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, ship_to_ray_workers, write  # noqa: E402  (sets TPU_SKIP_MDS_QUERY first)
from benchmarks import step_overhead  # noqa: E402

NAME = "strategy_memory"
TOPOLOGY, ACCEL = "2x2x1", "TPU-V4"
WORLD = 4
STRATEGIES = ("ddp", "fsdp2", "tp", "fsdp2+tp")
TARGET = 1.1
MB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="rows per data-parallel rank")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated subset of {STRATEGIES}")
    p.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                   help="MALLOC_MMAP_THRESHOLD_ for the cluster's processes (bytes); 0 keeps glibc's dynamic default")
    p.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="RAY_worker_niceness for the cluster (Ray's default is 15); -1 keeps Ray's")
    args = p.parse_args(argv)
    for field in ("dim", "hidden", "blocks", "steps", "batch_size"):
        if getattr(args, field) < 1:
            p.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.malloc_mmap_threshold < 0:
        p.error(f"--malloc-mmap-threshold must be >= 0 bytes, got {args.malloc_mmap_threshold}")
    if args.dim % 4 or args.hidden % 4:
        p.error(f"--dim {args.dim} and --hidden {args.hidden} must be multiples of 4 (the ranks that shard them)")
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STRATEGIES]
    if bad or not chosen:
        p.error(f"--strategies {args.strategies!r}: unknown {bad}; choose from {', '.join(STRATEGIES)}")
    args.strategies = chosen
    return args


def mlp(dim: int, hidden: int, blocks: int):
    from torch import nn

    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim)]
    return nn.Sequential(*layers)


def tp_plan(blocks: int) -> dict:
    """Megatron-style: the up projection column-wise, the down projection row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for b in range(blocks):
        plan[str(3 * b)], plan[str(3 * b + 2)] = ColwiseParallel(), RowwiseParallel()
    return plan


def strategy_object(name: str, blocks: int):
    from ray_train_tpu.strategies import FSDP2TPStrategy, TensorParallelStrategy

    if name == "tp":
        return TensorParallelStrategy(plan=tp_plan(blocks), tp_size=WORLD)
    if name == "fsdp2+tp":
        return FSDP2TPStrategy(plan=tp_plan(blocks), tp_size=2)
    return name


def local_bytes(tensor) -> int:
    """Bytes this rank holds for `tensor`: a DTensor's local shard, else the tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def state_bytes(model, opt) -> dict:
    import torch

    params = list(model.parameters())
    opt_bytes = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": opt_bytes,
    }


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def chip_memory() -> dict:
    """This rank's chip memory, as torch.accelerator reports it (None where unknown)."""
    from ray_train_tpu.device import accelerator_memory

    chip = accelerator_memory()
    return {"device_allocated_bytes": chip.get("allocated_bytes"), "device_peak_bytes": chip.get("peak_bytes"),
            "device_total_bytes": chip.get("total_bytes")}


def memory_loop(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    import ray_train_tpu
    from ray_train_tpu.prepare import current_strategy

    torch.set_num_threads(1)
    rss_before = peak_rss_bytes()
    device = ray_train_tpu.get_device()
    torch.manual_seed(0)
    model = ray_train_tpu.prepare_model(mlp(cfg["dim"], cfg["hidden"], cfg["blocks"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shard = current_strategy().distributed_sampler_kwargs  # tensor-parallel peers read the same rows
    gen = torch.Generator().manual_seed(100 + shard["rank"])
    for _ in range(cfg["steps"]):
        x = torch.randn(cfg["batch_size"], cfg["dim"], generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
    del x
    mine = {"rank": dist.get_rank(), **state_bytes(model, opt), **chip_memory(), "peak_rss_bytes": peak_rss_bytes(),
            "peak_rss_before_model_bytes": rss_before, "model_type": type(model).__name__,
            "dp_replicas": shard["num_replicas"], "niceness": os.nice(0),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    mine["state_bytes"] = mine["param_bytes"] + mine["grad_bytes"] + mine["optimizer_bytes"]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    step_overhead.report_from_rank0({"strategy": cfg["strategy"], "ranks": everyone})


def run_strategy(name: str, args, storage: str) -> dict:
    import ray.train

    from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer

    cfg = {"strategy": name, **{k: getattr(args, k) for k in ("dim", "hidden", "blocks", "steps", "batch_size")}}
    result = TPUTorchTrainer(
        memory_loop, train_loop_config=cfg,
        scaling_config=TPUScalingConfig(topology=TOPOLOGY, accelerator_type=ACCEL),
        run_config=ray.train.RunConfig(name=f"{NAME}_{name.replace('+', '_')}", storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=0)),
        strategy=strategy_object(name, args.blocks),
    ).fit()
    if result.error is not None:
        raise result.error
    return strategy_row(name, result.metrics["ranks"])


def strategy_row(name: str, ranks: list[dict]) -> dict:
    """One strategy's figures: the largest rank's, for each quantity."""
    def most(key):
        values = [r[key] for r in ranks if r.get(key) is not None]
        return max(values) if values else None

    worst = max(ranks, key=lambda r: r["state_bytes"])
    return {"strategy": name, "ranks": ranks, "max_state_bytes": worst["state_bytes"],
            "max_param_bytes": most("param_bytes"), "max_grad_bytes": most("grad_bytes"),
            "max_optimizer_bytes": most("optimizer_bytes"),
            "max_device_allocated_bytes": most("device_allocated_bytes"),
            "max_device_peak_bytes": most("device_peak_bytes"), "device_total_bytes": most("device_total_bytes"),
            "max_peak_rss_bytes": most("peak_rss_bytes"),
            "max_rss_growth_bytes": max(r["peak_rss_bytes"] - r["peak_rss_before_model_bytes"] for r in ranks)}


def summarize(rows: list[dict], num_params: int) -> dict:
    by = {r["strategy"]: r for r in rows}
    out = {"num_params": num_params, "full_state_bytes": num_params * 4 * 4}  # fp32 param, grad, 2 Adam moments
    if "ddp" in by:
        ideal = by["ddp"]["max_state_bytes"] / WORLD
        out["ddp_over_world_bytes"] = ideal
        for r in rows:
            r["state_over_ddp_per_world"] = r["max_state_bytes"] / ideal
        if "fsdp2" in by:
            ratio = by["fsdp2"]["state_over_ddp_per_world"]
            out["fsdp2_target"] = {"target": f"FSDP2 per-rank state <= {TARGET} x (DDP / world size)",
                                   "measured": ratio, "met": ratio <= TARGET}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    from ray_train_tpu.testing import simulated_tpu_cluster

    ship_to_ray_workers(sys.modules[__name__], step_overhead)
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(args.malloc_mmap_threshold)} if args.malloc_mmap_threshold > 0 else {}
    step_overhead.set_cluster_env(args.ray_worker_niceness, **malloc)
    num_params = sum(p.numel() for p in mlp(args.dim, args.hidden, args.blocks).parameters())
    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="rtt_memory_") as storage, simulated_tpu_cluster(TOPOLOGY, ACCEL):
        for name in args.strategies:
            rows.append(run_strategy(name, args, storage))
            r = rows[-1]
            print(f"{name:9} state/rank {r['max_state_bytes'] / MB:7.1f} MiB  chip peak {_mib(r['max_device_peak_bytes'])} "
                  f"MiB  peak RSS {r['max_peak_rss_bytes'] / MB:7.0f} MiB", flush=True)
    result = {
        "question": "how much does each strategy hold per rank?",
        "environment": environment(simulated=True),
        "note": ("Counted bytes (local shards of DTensors) are exact and machine-independent; the chip's "
                 "figures are torch.accelerator's memory_allocated / max_memory_allocated after the last step "
                 "(SIMULATED: the bytes of live simulated device tensors; HBM on a TPU); peak RSS "
                 "is per process and includes the full model built before sharding, activations, "
                 "FSDP2's all-gathered parameters and DDP's gradient buckets."),
        "settings": {"topology": TOPOLOGY, "accelerator_type": ACCEL, "world_size": WORLD, "dim": args.dim,
                     "hidden": args.hidden, "blocks": args.blocks, "steps": args.steps,
                     "batch_size": args.batch_size, "optimizer": "AdamW", "dtype": "float32",
                     "tp_size": {"tp": WORLD, "fsdp2+tp": 2}, "ray_worker_niceness": args.ray_worker_niceness,
                     "malloc_mmap_threshold": args.malloc_mmap_threshold or "glibc default (dynamic)"},
        "rows": rows, **summarize(rows, num_params), "total_wall_s": time.perf_counter() - started,
    }
    path = write(NAME, result)
    _print_table(result)
    _plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return result


def _mib(n) -> str:
    return f"{n / MB:8.1f}" if n is not None else f"{'n/a':>8}"


def _print_table(result):
    print(f"\nper rank (max over {WORLD} ranks), MiB, {result['num_params'] / 1e6:.1f} M params "
          "[SIMULATED slice, CPU, gloo]")
    print(f"{'strategy':9} {'params':>8} {'grads':>8} {'AdamW':>8} {'state':>8} {'x DDP/4':>8} {'chip now':>8} "
          f"{'chip peak':>9} {'peak RSS':>9} {'RSS growth':>10}")
    for r in result["rows"]:
        ratio = r.get("state_over_ddp_per_world")
        print(f"{r['strategy']:9} {r['max_param_bytes'] / MB:8.1f} {r['max_grad_bytes'] / MB:8.1f} "
              f"{r['max_optimizer_bytes'] / MB:8.1f} {r['max_state_bytes'] / MB:8.1f} "
              f"{ratio if ratio is not None else float('nan'):8.3f} {_mib(r.get('max_device_allocated_bytes'))} "
              f"{_mib(r.get('max_device_peak_bytes'))} {r['max_peak_rss_bytes'] / MB:9.0f} "
              f"{r['max_rss_growth_bytes'] / MB:10.0f}")
    t = result.get("fsdp2_target")
    if t:
        print(f"{t['target']}: {t['measured']:.3f} -> {'met' if t['met'] else 'NOT met'}")


def _plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for key, label in (("max_param_bytes", "parameters"), ("max_grad_bytes", "gradients"),
                       ("max_optimizer_bytes", "AdamW state")):
        vals = [r[key] / MB for r in rows]
        ax.bar(xs, vals, bottom=bottom, label=label, width=0.5)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(xs, [r["max_rss_growth_bytes"] / MB for r in rows], "kD", label="peak RSS growth")
    if all(r.get("max_device_peak_bytes") is not None for r in rows):
        ax.plot(xs, [r["max_device_peak_bytes"] / MB for r in rows], "r^", label="chip peak (torch.accelerator)")
    if "ddp_over_world_bytes" in result:
        ax.axhline(result["ddp_over_world_bytes"] / MB, color="gray", ls="--", label="DDP / world size")
    ax.set_xticks(list(xs), [r["strategy"] for r in rows])
    ax.set_ylabel("MiB per rank (max over ranks)")
    ax.set_title(f"{result['num_params'] / 1e6:.1f} M-param MLP, AdamW, {WORLD} ranks [SIMULATED slice]", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
