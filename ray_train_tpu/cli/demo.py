"""``python -m ray_train_tpu demo``: the announcement's example on a simulated slice.

Prints the slice plan for a 4x4 TPU-V6E slice (4 hosts x 4 chips), starts a
SIMULATED copy of it (a real multi-raylet Ray cluster; a simulated "tpu"
device over CPU memory, gloo), runs
the all_reduce over plain Ray actors, then trains a small model with
`TPUTorchTrainer` and prints the loss and throughput of every step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, TextIO

from ray_train_tpu import _environ
from ray_train_tpu import constants as C

BANNER = (
    "*** SIMULATED TPU slice: a real Ray cluster whose nodes look like TPU hosts; "
    "tensors live on a simulated 'tpu' device (CPU memory) and collectives use gloo. No TPU is used. ***"
)


ORDER = 20
EXAMPLE = 'python -m ray_train_tpu demo --steps 12'


def register(subparsers, add_slice_args) -> None:
    p = subparsers.add_parser("demo", help="train on a simulated TPU slice (CPU, gloo)")
    add_slice_args(p, topology="4x4", accelerator_type="TPU-V6E", num_slices=False)
    p.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    p.add_argument("--strategy", default="ddp", help="ddp, fsdp2, tp, fsdp2+tp")
    p.add_argument("--verbose", action="store_true",
                   help=f"show Ray's own INFO lines too, e.g. one per report per worker ({C.RAY_TRAIN_TPU_VERBOSE}=1)")
    p.set_defaults(func=run)


def is_verbose(args: argparse.Namespace) -> bool:
    """--verbose, or RAY_TRAIN_TPU_VERBOSE=1 in the environment."""
    return bool(getattr(args, "verbose", False)) or _environ.get(C.RAY_TRAIN_TPU_VERBOSE) == "1"


def quiet_logs() -> None:
    """In a worker: INFO records of loggers without a level of their own (Ray Train's
    "Reporting training result ..." line, once per report per worker) are dropped.
    Ray Train's own ``ray.train`` loggers follow the run's ``LoggingConfig`` instead
    (`run_config`), and its session log files keep everything either way."""
    import logging

    logging.getLogger().setLevel(logging.WARNING)


def run_config(storage_path: Optional[str], verbose: bool):
    """The demo's RunConfig: Ray Train's console logs at WARNING unless verbose; a
    run of its own (a new name each time) under `storage_path`, by default Ray
    Train's (``~/ray_results``)."""
    import ray.train

    logging_config = None if verbose else ray.train.LoggingConfig(log_level="WARNING")
    name = time.strftime("ray_train_tpu_demo_%Y%m%d_%H%M%S_") + f"{os.getpid()}"
    return ray.train.RunConfig(name=name, storage_path=storage_path, logging_config=logging_config)


def _train_loop(config: dict) -> None:
    """The user's training loop: nothing TPU-specific but the device."""
    import torch
    import torch.distributed as dist

    import ray.train
    import ray_train_tpu
    from ray_train_tpu.throughput import ThroughputMeter

    if not config.get("verbose"):
        quiet_logs()
    torch.manual_seed(0)
    device = ray_train_tpu.get_device()
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )
    n_params = sum(p.numel() for p in model.parameters())
    model = ray_train_tpu.prepare_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.linspace(-1, 1, 64)
    meter = ThroughputMeter(flops_per_sample=6 * n_params)
    batch = config["batch_size"]
    for step in range(1, config["steps"] + 1):
        x = torch.randn(batch, 64, generator=gen)
        y = (x @ w_true).unsqueeze(1) + 0.01 * torch.randn(batch, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        metrics = {"step": step, "loss": mean_loss.item() / world, **meter.step(batch)}
        if rank == 0:
            print(
                f"[SIMULATED] step {step:3d}  loss {metrics['loss']:.4f}  "
                f"{metrics['samples_per_s']:8.0f} samples/s  step {metrics['step_time_s'] * 1e3:6.1f} ms",
                # The worker's own stdout: Ray Train 2.60 patches print() to log
                # a line and also echo it, and the driver then showed it twice.
                file=sys.__stdout__,
                flush=True,
            )
        checkpoint = None
        if step == config["steps"] and rank == 0:
            checkpoint = _save_final(model)
        ray.train.report(metrics, checkpoint=checkpoint)


def _save_final(model):
    """A last checkpoint (rank 0, DDP replicas are identical), as users keep one."""
    import tempfile

    import torch

    import ray.train

    directory = tempfile.mkdtemp(prefix="demo_ckpt_")
    torch.save(model.state_dict(), f"{directory}/model.pt")
    return ray.train.Checkpoint.from_directory(directory)


def _all_reduce_over_actors(out: TextIO, num_workers: int) -> None:
    import ray

    import ray_train_tpu

    @ray.remote(resources={"TPU": 1}, num_cpus=0)
    class Worker:
        def all_reduce(self):
            import os

            import torch
            import torch.distributed as dist

            t = torch.ones(1, device=ray_train_tpu.get_device()) * dist.get_rank()
            dist.all_reduce(t)
            return int(os.environ["RANK"]), t.item()

    actors = [Worker.remote() for _ in range(num_workers)]
    try:
        actors = ray_train_tpu.setup_process_group(actors)
        results = ray.get([a.all_reduce.remote() for a in actors])
        expected = sum(range(num_workers))
        ok = all(total == expected for _, total in results)
        out.write(f"all_reduce over {num_workers} Ray actors (TPU: 1 each): every rank got "
                  f"{results[0][1]:.0f} (expected {expected}) -> {'OK' if ok else 'WRONG'} [SIMULATED]\n")
        ray_train_tpu.shutdown_process_group(actors)
    finally:
        for a in actors:
            ray.kill(a)


def run(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = sys.stdout if out is None else out
    from ray_train_tpu.cli.plan import build_plan, format_plan_table
    from ray_train_tpu.topology import Topology

    from ray_train_tpu import _validate as V

    V.check_int("", "--steps", args.steps, min=1, max=100_000, fix="e.g. --steps 12")
    topology = Topology.parse(args.topology, args.accelerator_type)
    out.write(BANNER + "\n\n")
    out.write(format_plan_table(build_plan(topology), max_rows=16))
    out.flush()

    from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer
    from ray_train_tpu.cli import running
    from ray_train_tpu.testing import simulated_tpu_cluster

    with running("the demo"):
        start = time.perf_counter()
        with simulated_tpu_cluster(topology.name, topology.accelerator_type) as sim:
            out.write(f"\nsimulated cluster up: {len(sim.hosts)} hosts ({', '.join(sorted(sim.hosts.values()))}) "
                      f"in {time.perf_counter() - start:.0f} s\n")
            out.flush()
            _all_reduce_over_actors(out, topology.num_devices)
            verbose = is_verbose(args)
            if not verbose:
                out.write(f"training ({C.RAY_TRAIN_TPU_VERBOSE}=1 or --verbose also shows Ray's own log lines):\n")
            out.flush()
            trainer = TPUTorchTrainer(
                _train_loop,
                train_loop_config={"steps": args.steps, "batch_size": 32, "verbose": verbose},
                scaling_config=TPUScalingConfig(topology=topology.name, accelerator_type=topology.accelerator_type),
                # Ray Train's default storage: outside every simulated host's own disk, so it
                # stands for storage all hosts see (a bucket or NFS on a real cluster), and it
                # outlives the cluster: the checkpoint printed below is still there.
                run_config=run_config(None, verbose),
                strategy=args.strategy,
            )
            fit_start = time.perf_counter()
            result = trainer.fit()
            if result.error is not None:
                raise result.error
            final = result.metrics or {}
            out.write(
                f"\ntrained {args.steps} steps with strategy={args.strategy!r} on {topology.num_devices} "
                f"SIMULATED {topology.accelerator_type} workers in {time.perf_counter() - fit_start:.0f} s; "
                f"final loss {final.get('loss', float('nan')):.4f}; checkpoint: "
                f"{result.checkpoint.path if result.checkpoint else 'none'}\n"
            )
    out.write(f"demo finished in {time.perf_counter() - start:.0f} s (SIMULATED: 'tpu' device over CPU memory, gloo)\n")
    out.flush()  # the summary reaches a pipe or a log now, not when the interpreter exits
    return 0
