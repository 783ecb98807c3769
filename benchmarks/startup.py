"""Start-up cost: from ``fit()`` to the first completed step, TPUTorchTrainer vs Ray's TorchTrainer.

For 4 and 8 workers (SIMULATED v4 2x2x1 and 2x2x2 slices; 16 = v6e 4x4 with
``--with-16``), one simulated cluster at a time, both trainers run the same
loop (build a small MLP, ``prepare_model``, one AdamW step) with the same number
of workers: ``TPUTorchTrainer`` on the slice (``{"TPU": 1}`` per worker) and
``TorchTrainer`` with ``ScalingConfig(num_workers=N)`` CPU workers (gloo).

Measured per fit:

- ``fit_to_first_step_s``: rank 0's wall clock when its first step completes,
  minus the driver's ``time.time()`` taken just before the trainer is built and
  ``fit()`` called (passed in the loop's config; one machine, one clock);
- ``fit_to_loop_s``: the same up to the first line of the training function;
- ``on_start_s``: the backend's ``on_start`` alone (ours: ``_TPUTorchBackend``,
  Ray's: ``_TorchBackend``), timed by a subclass that the benchmark's config
  subclass names in ``backend_cls``; the controller writes it to a file.

- ``coords_query_s`` (ours, multi-host slices): the one child process per host
  that asks torch_tpu (here the simulated libtpu) for the host's chip
  coordinates, timed in the worker that ran it; asked once per Ray node, so
  only a cluster's first fit pays it (later fits read the answer). On a TPU
  host the child starts a PJRT client: its cost there is unmeasured.

Runs alternate ours/theirs and swap who goes first every repeat (A B B A), so
the first fit in a fresh cluster is not always the same trainer's. Target:
ours <= 1.1 x TorchTrainer (median fit-to-first-step). Ray workers run at
``--ray-worker-niceness`` (default 0; Ray's default 15), as in step_overhead.py.

Writes benchmarks/results/startup.json (+ .png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, ship_to_ray_workers, write  # noqa: E402  (sets TPU_SKIP_MDS_QUERY first)
from benchmarks import step_overhead  # noqa: E402
from ray.train.torch import TorchConfig  # noqa: E402

from ray_train_tpu._backend import _TPUTorchBackend  # noqa: E402
from ray_train_tpu._compat.ray_train import RayTorchBackend as _TorchBackend  # noqa: E402
from ray_train_tpu.config import TPUTorchConfig  # noqa: E402

NAME = "startup"
TARGET = 1.1
SLICES = {4: ("2x2x1", "TPU-V4"), 8: ("2x2x2", "TPU-V4"), 16: ("4x4", "TPU-V6E")}
TRAINERS = ("ours", "torch_trainer")
# fit() -> first step, in order: the controller, placement group and worker
# processes; the backend; dispatching the training function; the first step.
PHASES = ("fit_to_on_start_s", "on_start_s", "on_start_to_loop_s", "loop_to_first_step_s")
NOTE = ("Absolute times on this shared 2-core machine are noise; compare the ratios, measured side by "
        "side in one run with the trainers interleaved, the first one swapped every repeat (A B B A).")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,8", help=f"comma-separated worker counts from {sorted(SLICES)}")
    p.add_argument("--with-16", action="store_true", help="add 16 workers (SIMULATED v6e 4x4; ~4 GB more RAM)")
    p.add_argument("--repeats", type=int, default=2, help="fits per trainer and size")
    p.add_argument("--ray-worker-niceness", type=int, default=0,
                   help="RAY_worker_niceness for the cluster (Ray's default is 15); -1 keeps Ray's")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes {args.sizes!r} must be comma-separated integers, e.g. 4,8")
    if args.with_16 and 16 not in sizes:
        sizes.append(16)
    bad = [s for s in sizes if s not in SLICES]
    if bad or not sizes:
        p.error(f"--sizes {args.sizes!r}: {bad} not simulated here; choose from {sorted(SLICES)}")
    args.sizes = sizes
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


# --- timed backends: on_start alone, written by the controller to a file --------

def _record(path: str, start: float) -> None:
    if path:
        Path(path).write_text(json.dumps({"on_start_begin": start, "on_start_end": time.time()}))


class _TimedTPUTorchBackend(_TPUTorchBackend):
    def on_start(self, worker_group, backend_config):
        start = time.time()
        super().on_start(worker_group, backend_config)
        _record(backend_config.timing_file, start)


class _TimedTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config):
        start = time.time()
        super().on_start(worker_group, backend_config)
        _record(backend_config.timing_file, start)


@dataclasses.dataclass
class TimedTPUTorchConfig(TPUTorchConfig):
    timing_file: str = ""

    @property
    def backend_cls(self):
        return _TimedTPUTorchBackend


@dataclasses.dataclass
class TimedTorchConfig(TorchConfig):
    timing_file: str = ""

    @property
    def backend_cls(self):
        return _TimedTorchBackend


# --- the loop ----------------------------------------------------------------

def first_step_loop(cfg: dict) -> None:
    loop_start = time.time()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if cfg["trainer"] == "ours":
        import ray_train_tpu

        device, prepare = ray_train_tpu.get_device(), ray_train_tpu.prepare_model
    else:
        import ray.train.torch

        device, prepare = ray.train.torch.get_device(), ray.train.torch.prepare_model
    torch.manual_seed(0)
    model = prepare(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64, device=device), torch.randn(16, 1, device=device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    loss.item()
    first_step = time.time()
    import psutil

    coords = None
    if cfg["trainer"] == "ours":
        from ray_train_tpu import _worker_fns

        # rank 0 holds TPU id 0 of the first host: on a multi-host slice it asked torch_tpu
        # (here: the simulated libtpu) for its host's chip coordinates, in one child process
        coords = _worker_fns.host_coords_record()
    step_overhead.report_from_rank0({
        "coords_query_s": None if coords is None else coords["seconds"],
        "coords_found": None if coords is None else coords["coords"] is not None,
        "trainer": cfg["trainer"], "fit_to_worker_process_s": psutil.Process().create_time() - cfg["fit_t0"],
        "loop_start": loop_start, "fit_to_loop_s": loop_start - cfg["fit_t0"],
        "fit_to_first_step_s": first_step - cfg["fit_t0"], "loop_to_first_step_s": first_step - loop_start,
        "niceness": os.nice(0), "process_group": dist.get_backend(), "world_size": dist.get_world_size(),
        "torch_tpu_env_applied": "TORCH_TPU_SLICEBUILDER_ADDRESSES" in os.environ,  # ours must set it, Ray's not
    })


def run_fit(trainer: str, size: int, storage: str, index: int) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    from ray_train_tpu import TPUScalingConfig, TPUTorchTrainer

    topology, accel = SLICES[size]
    timing = Path(storage, f"on_start_{trainer}_{size}_{index}.json")
    run_config = ray.train.RunConfig(name=f"{NAME}_{trainer}_{size}_{index}", storage_path=storage,
                                     failure_config=ray.train.FailureConfig(max_failures=0))
    fit_t0 = time.time()  # just before the trainer is built and fit() called
    cfg = {"trainer": trainer, "fit_t0": fit_t0}
    if trainer == "ours":
        fit = TPUTorchTrainer(first_step_loop, train_loop_config=cfg, run_config=run_config,
                              scaling_config=TPUScalingConfig(topology=topology, accelerator_type=accel),
                              torch_config=TimedTPUTorchConfig(timing_file=str(timing))).fit
    else:
        fit = TorchTrainer(first_step_loop, train_loop_config=cfg, run_config=run_config,
                           scaling_config=ray.train.ScalingConfig(num_workers=size),
                           torch_config=TimedTorchConfig(backend="gloo", timing_file=str(timing))).fit
    result = fit()
    fit_s = time.time() - fit_t0
    if result.error is not None:
        raise result.error
    on_start = json.loads(timing.read_text())
    return {**result.metrics, "on_start_s": on_start["on_start_end"] - on_start["on_start_begin"],
            "fit_to_on_start_s": on_start["on_start_begin"] - fit_t0,
            "on_start_to_loop_s": result.metrics["loop_start"] - on_start["on_start_end"],
            "fit_s": fit_s, "num_workers": size, "topology": topology, "accelerator_type": accel}


# --- summary -----------------------------------------------------------------

def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for size in sorted({r["num_workers"] for r in runs}):
        row = {"num_workers": size}
        for trainer in TRAINERS:
            mine = [r for r in runs if r["num_workers"] == size and r["trainer"] == trainer]
            for key in PHASES + ("fit_to_first_step_s", "fit_to_worker_process_s", "fit_s"):
                if mine:
                    row[f"{trainer}_{key}"] = statistics.median(r[key] for r in mine)
            asked = [r["coords_query_s"] for r in mine if r.get("coords_query_s") is not None]
            if trainer == "ours":
                # one child per host, once per Ray node: the first fit on a cluster asks, later ones read
                row["ours_coords_query_s"] = max(asked) if asked else None
                row["ours_coords_found"] = all(r["coords_found"] for r in mine if r.get("coords_found") is not None)
        if "ours_fit_to_first_step_s" in row and "torch_trainer_fit_to_first_step_s" in row:
            ratio = row["ours_fit_to_first_step_s"] / row["torch_trainer_fit_to_first_step_s"]
            row["ratio_fit_to_first_step"] = ratio
            row["ratio_on_start"] = row["ours_on_start_s"] / row["torch_trainer_on_start_s"]
            row["target"] = f"ours <= {TARGET} x TorchTrainer (fit to first step)"
            row["met"] = ratio <= TARGET
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    from ray_train_tpu.testing import simulated_tpu_cluster

    ship_to_ray_workers(sys.modules[__name__], step_overhead)
    step_overhead.set_cluster_env(args.ray_worker_niceness)
    runs, started = [], time.perf_counter()
    for size in args.sizes:
        topology, accel = SLICES[size]
        with tempfile.TemporaryDirectory(prefix="rtt_startup_") as storage, simulated_tpu_cluster(topology, accel):
            for repeat in range(args.repeats):
                order = TRAINERS if repeat % 2 == 0 else TRAINERS[::-1]
                for trainer in order:
                    run = {**run_fit(trainer, size, storage, repeat), "repeat": repeat}
                    runs.append(run)
                    phases = "  ".join(f"{k[:-2]} {run[k]:.2f}" for k in PHASES)
                    print(f"{size:3d} workers  {trainer:14} fit->first step {run['fit_to_first_step_s']:6.1f} s  "
                          f"({phases}; niceness {run['niceness']})", flush=True)
    rows = summarize(runs)
    result = {
        "question": "how long from fit() to the first step, against Ray's TorchTrainer?",
        "environment": environment(simulated=True),
        "note": NOTE,
        "settings": {"sizes": args.sizes, "repeats": args.repeats, "ray_worker_niceness": args.ray_worker_niceness,
                     "slices": {n: SLICES[n] for n in args.sizes}},
        "rows": rows, "runs": runs,
        "targets_met": all(r.get("met", False) for r in rows),
        "total_wall_s": time.perf_counter() - started,
    }
    path = write(NAME, result)
    _print_table(rows)
    _plot(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return result


def _print_table(rows):
    print("\nmedian seconds [SIMULATED slices, CPU, gloo]; ratio = ours / TorchTrainer")
    print(f"{'workers':>7} {'ours fit->step':>15} {'Ray fit->step':>14} {'ratio':>6} "
          f"{'ours on_start':>14} {'Ray on_start':>13} {'ratio':>6} {'coords query':>13}  target <= {TARGET}")
    for r in rows:
        query = "-" if r.get("ours_coords_query_s") is None else f"{r['ours_coords_query_s']:.2f} s"
        print(f"{r['num_workers']:7d} {r['ours_fit_to_first_step_s']:15.1f} {r['torch_trainer_fit_to_first_step_s']:14.1f} "
              f"{r['ratio_fit_to_first_step']:6.2f} {r['ours_on_start_s']:14.2f} {r['torch_trainer_on_start_s']:13.2f} "
              f"{r['ratio_on_start']:6.2f} {query:>13}  {'met' if r['met'] else 'NOT met'}")


def _plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    labels, xs = [], []
    for j, r in enumerate(rows):
        for i, trainer in enumerate(TRAINERS):
            x = j * 3 + i
            bottom = 0.0
            for k, phase in enumerate(PHASES):
                value = r[f"{trainer}_{phase}"]
                left.bar(x, value, bottom=bottom, color=f"C{k}", label=phase[:-2] if x == 0 else None)
                bottom += value
            xs.append(x)
            labels.append(f"{'ours' if trainer == 'ours' else 'Ray'}\n{r['num_workers']} w")
    left.set_xticks(xs, labels, fontsize=8)
    left.set_ylabel("seconds (median)")
    left.set_title("fit() to first step, by phase [SIMULATED slice]", fontsize=10)
    left.legend(fontsize=7)
    for i, trainer in enumerate(TRAINERS):
        right.bar([j + (i - 0.5) * 0.35 for j in range(len(rows))], [r[f"{trainer}_on_start_s"] for r in rows],
                  width=0.35, label="ours" if trainer == "ours" else "Ray TorchTrainer")
    right.set_xticks(range(len(rows)), [f"{r['num_workers']} workers" for r in rows])
    right.set_title("backend on_start alone", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
