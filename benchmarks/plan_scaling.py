"""How the set-up cost (`launch_envs` / `build_plan`) grows with the slice.

For slices from 4 chips to the largest that exist (v4 16x16x16, v5p 16x16x24,
v7x 8x16x16), time `build_plan` (every worker's complete env) and the per-worker
time. It should be linear in the workers: the shared address list is built once
per slice. Serialising the plan to JSON (``plan --format json``) is timed apart, for
every slice: values shared by the job or a slice are written once, so the JSON is
linear too; the fully expanded form (``--expand-env``: every worker repeats its
slice's address list, as torch_tpu's env requires) is quadratic and is timed up to
``--expanded-up-to`` workers, for comparison.

Writes benchmarks/results/plan_scaling.json (+ .png when matplotlib is present).
Pure CPU work, no TPU involved: "simulated" is false because nothing is simulated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, write  # noqa: E402
from ray_train_tpu.cli.plan import build_plan  # noqa: E402
from ray_train_tpu.topology import Topology  # noqa: E402

CASES = [
    ("2x2", "TPU-V6E"), ("4x4", "TPU-V6E"), ("8x8", "TPU-V6E"), ("16x16", "TPU-V6E"),
    ("4x4x8", "TPU-V4"), ("8x8x16", "TPU-V4"), ("16x16x16", "TPU-V4"),
    ("16x16x24", "TPU-V5P"), ("8x16x16", "TPU-V7X"),
]


def _best_of(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--expanded-up-to", type=int, default=2048,
                        help="time the expanded (quadratic) JSON up to this many workers")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    rows = []
    for name, accel in CASES:
        t = Topology.parse(name, accel)
        plan_s = _best_of(lambda: build_plan(t), args.repeats)
        row = {"accelerator_type": accel, "topology": name, "pod_type": t.pod_type,
               "num_workers": t.num_devices, "plan_s": plan_s, "plan_us_per_worker": plan_s / t.num_devices * 1e6}
        plan = build_plan(t)
        start = time.perf_counter()
        text = json.dumps(plan, separators=(",", ":"))
        row["json_s"], row["json_bytes"] = time.perf_counter() - start, len(text)
        row["json_bytes_per_worker"] = len(text) / t.num_devices
        if t.num_devices <= args.expanded_up_to:
            expanded = build_plan(t, expand_env=True)
            start = time.perf_counter()
            text = json.dumps(expanded, separators=(",", ":"))
            row["expanded_json_s"], row["expanded_json_bytes"] = time.perf_counter() - start, len(text)
        rows.append(row)
        print(f"{accel:14} {name:9} {t.num_devices:6} workers  plan {plan_s * 1e3:8.2f} ms  "
              f"({row['plan_us_per_worker']:.2f} us/worker)  json {row['json_bytes'] / 1e6:7.2f} MB "
              f"{row['json_s'] * 1e3:7.1f} ms", flush=True)
    small, large = rows[0], max(rows, key=lambda r: r["num_workers"])
    result = {
        "question": "how does the plan/launch_env cost grow with the slice?",
        "environment": environment(simulated=False),
        "rows": rows,
        "largest_plan_s": max(r["plan_s"] for r in rows),
        "per_worker_cost_ratio_largest_to_smallest": large["plan_us_per_worker"] / small["plan_us_per_worker"],
        "json_bytes_per_worker_ratio_largest_to_smallest": large["json_bytes_per_worker"] / small["json_bytes_per_worker"],
        "largest_json_bytes": large["json_bytes"],
        "target": "largest slice well under 1 s; per-worker cost and JSON bytes per worker roughly constant (linear)",
    }
    path = write("plan_scaling", result)
    _plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")
    return result


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["num_workers"] for r in rows]
    ax.loglog(xs, [r["plan_s"] for r in rows], "o-", label="build_plan (all workers)")
    ax.loglog(xs, [r["json_s"] for r in rows], "s--", label="json.dumps of the plan (linear form)")
    ex = [(r["num_workers"], r["expanded_json_s"]) for r in rows if "expanded_json_s" in r]
    if ex:
        ax.loglog(*zip(*ex), "x:", label="json.dumps, --expand-env (quadratic)")
    ax.set_xlabel("workers (TPU devices)")
    ax.set_ylabel("seconds")
    ax.set_title("plan cost vs slice size")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
