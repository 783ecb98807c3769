"""GRPO on two simulated slices: time per phase, and weight-sync time vs model size.

1. Phases: the demo run (tiny addition model, 32 prompts x 8 samples, FSDP2 over
   4 simulated chips, one vLLM engine) for ``--steps`` steps; the median time of
   rollout, reward, train, checkpoint, sync and parity per step, and sync as a
   fraction of the step (goal: under 10 %).
2. Sync vs size: for each model (``tiny`` 0.3 M, ``medium`` 25 M parameters,
   and SmolLM2-135M with ``--smollm2``) a loop is started and the weights are
   synced ``--syncs`` times without training: publish (FSDP2 gather on the
   trainer + cast + ``ray.put``), the engine's load (transfer + vLLM's
   ``reload_weights``), and the parity check, with the bytes moved.

Everything runs on a SIMULATED cluster (CPU, gloo, vLLM's CPU backend) on a
shared 2-core machine: the absolute numbers say little about TPUs; the ratios
and the growth with size are the point. Run with ``flock /tmp/simcluster.lock``.

    python benchmarks/rl_phases.py [--steps 15] [--syncs 3] [--smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import _common  # noqa: E402  (sets TPU_SKIP_MDS_QUERY before torch)

PHASES = ("rollout_s", "reward_s", "train_s", "checkpoint_s", "sync_s", "parity_s", "step_s")


def _config(model_dir: str, **kw):
    from ray_train_tpu.rl.loop import GRPOConfig
    from ray_train_tpu.rl.rollout import SamplingConfig
    from ray_train_tpu.rl.tasks import addition_task

    return GRPOConfig(model_dir=model_dir, task=addition_task(max_operand=2), num_prompts=32,
                      sampling=SamplingConfig(n=8, max_tokens=3), lr=3e-3, seed=0,
                      checkpoint_dir=tempfile.mkdtemp(prefix="rl_bench_ckpt_"), **kw)


def phases(model_dir: str, steps: int) -> dict:
    from ray_train_tpu.rl.loop import GRPOLoop

    with GRPOLoop(_config(model_dir)) as loop:
        history = loop.run(steps)
    med = {p: statistics.median(m[p] for m in history) for p in PHASES}
    return {"steps": steps, "num_params": loop.num_params, "median_s": med,
            "sync_fraction_of_step": statistics.median(m["sync_s"] / m["step_s"] for m in history),
            "reward_mean": [m["reward_mean"] for m in history]}


def sync_vs_size(name: str, model_dir: str, syncs: int) -> dict:
    import ray

    from ray_train_tpu.rl.loop import GRPOLoop

    with GRPOLoop(_config(model_dir, max_model_len=128 if name.startswith("smollm2") else 64)) as loop:
        runs = [loop._sync(check=True) for _ in range(syncs)]
        wrapped = [r[0] for r in loop.trainer.call("publish_weights", loop.config.engine_dtype, "shards")]
        nbytes = sum(t.numel() * t.element_size() for shard in ray.get(wrapped) for t in shard.values())
    return {"model": name, "num_params": loop.num_params, "bytes": nbytes,
            **{k: statistics.median(r[k] for r in runs) for k in ("publish_s", "engine_load_s", "sync_s", "parity_s")}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    med = result["phases"]["median_s"]
    names = [p for p in PHASES if p != "step_s"]
    ax.bar([n[:-2] for n in names], [med[n] for n in names])
    ax.set_ylabel("median seconds per step")
    ax.set_title(f"GRPO phases, tiny model [SIMULATED]\nsync = {100 * result['phases']['sync_fraction_of_step']:.0f}% "
                 "of a step")
    sizes = result["sync_vs_size"]
    x = [s["num_params"] / 1e6 for s in sizes]
    for key in ("sync_s", "publish_s", "engine_load_s", "parity_s"):
        bx.plot(x, [s[key] for s in sizes], marker="o", label=key[:-2])
    bx.set_xscale("log"), bx.set_yscale("log")
    bx.set_xlabel("parameters (millions)"), bx.set_ylabel("seconds")
    bx.set_title("weight sync vs model size [SIMULATED]"), bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (GGUF conversion ~2 min once)")
    parser.add_argument("--name", default="rl_phases")
    args = parser.parse_args()

    from ray_train_tpu.rl import models
    from ray_train_tpu.testing import simulated_tpu_cluster

    cache = tempfile.mkdtemp(prefix="rl_bench_models_")
    sizes = [("tiny", models.tiny_addition_model(cache)), ("medium", models.tiny_addition_model(cache, size="medium"))]
    if args.smollm2:
        sizes.append(("smollm2-135m", models.smollm2_dir()))
    start = time.perf_counter()
    with simulated_tpu_cluster("2x2x1", "TPU-V4", num_slices=2):
        result = {"phases": phases(sizes[0][1], args.steps),
                  "sync_vs_size": [sync_vs_size(n, d, args.syncs) for n, d in sizes]}
    result["wall_s"] = time.perf_counter() - start
    result["environment"] = _common.environment(simulated=True)
    result["goal"] = "sync under 10% of a step for the demo model"
    path = _common.write(args.name, result)
    plot(result, path.with_suffix(".png"))
    print(f"[SIMULATED] wrote {path} and {path.with_suffix('.png')}")
    ph = result["phases"]
    print(f"[SIMULATED] phases (median s): " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in ph["median_s"].items())
          + f"; sync = {100 * ph['sync_fraction_of_step']:.0f}% of a step")
    for s in result["sync_vs_size"]:
        print(f"[SIMULATED] {s['model']:>13}: {s['num_params'] / 1e6:7.1f} M params, {s['bytes'] / 2**20:7.1f} MiB: "
              f"sync {s['sync_s']:.3f} s (publish {s['publish_s']:.3f}, engine load {s['engine_load_s']:.3f}), "
              f"parity {s['parity_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
