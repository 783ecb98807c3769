"""GRPO on simulated slices: time per phase, the gain of overlap mode, and weight
sync against the object store's own transfer rate, in one run.

1. Phases: the demo run (tiny addition model, 32 prompts x 8 samples, FSDP2
   over 4 simulated chips, 4 one-chip vLLM engines) for ``--steps`` steps,
   first step-by-step, then with ``overlap=True`` (same seeds): the median time
   of each phase and of a step in each mode.
2. Sync vs size: for each model size (``--sizes``, 1 M to 450 M parameters,
   bf16 on the wire) a loop is started (one TP4 engine) and the weights are
   synced ``--syncs`` times: publish (cast + ``ray.put`` on every trainer rank)
   and load (every engine worker fetches and loads through vLLM's
   weight-transfer API); parity is timed apart. Beside it, in the same
   cluster, **the limit**: an actor on the trainer's host ``ray.put``s the same
   number of bytes and an actor on the engine's host ``ray.get``s them (plain
   object store, one object). Goal: sync throughput >= 0.5 x the limit for
   >= 100 M parameters.
3. Overlap at 100 M: ``--overlap-steps`` steps of the 100 M model in overlap
   mode; sync (publish + load) as a share of a step. Goal: < 10 %.

Everything runs on a SIMULATED cluster (CPU, gloo, vLLM's CPU backend) on a
shared 2-core machine; the object stores are enlarged to hold the largest
model. Run under the shared lock:

    flock /tmp/rtt-sim.lock python benchmarks/rl_phases.py [--steps 12] [--syncs 3]
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
SIZES = ("bench-1m", "bench-10m", "bench-50m", "bench-100m", "bench-200m", "bench-450m")
OBJECT_STORE_BYTES = 3 * 2**30


def _config(model_dir: str, **kw):
    from ray_train_tpu.rl import AlgorithmConfig, GRPOConfig, SamplingConfig, addition_records, strict_answer_reward

    base = dict(model_dir=model_dir, prompts=addition_records(4096, max_operand=2), reward_fn=strict_answer_reward,
                num_prompts=32, sampling=SamplingConfig(n=8, max_tokens=3), lr=3e-3, seed=0, max_model_len=64,
                algorithm=AlgorithmConfig(num_minibatches=2),
                # the simulated hosts' shared storage (a driver-local temporary directory is refused)
                checkpoint_dir=tempfile.mkdtemp(prefix="ckpt-", dir=_STORAGE["path"]))
    return GRPOConfig(**{**base, **kw})


_STORAGE: dict = {}  # "path": the simulated cluster's storage_path


def _medians(history: list) -> dict:
    keys = PHASES + ("publish_s", "engine_load_s", "rollout_wait_s")
    return {k: statistics.median(m[k] for m in history) for k in keys if k in history[0]}


def phases(model_dir: str, steps: int) -> dict:
    from ray_train_tpu.rl import GRPOLoop

    out = {}
    for mode in ("sequential", "overlap"):
        with GRPOLoop(_config(model_dir, overlap=mode == "overlap")) as loop:
            history = loop.run(steps)
        timed = history[1:]  # the first step of overlap mode has nothing in flight
        out[mode] = {"steps": steps, "num_params": loop.num_params, "median_s": _medians(timed),
                     "sync_fraction_of_step": statistics.median(m["sync_s"] / m["step_s"] for m in timed),
                     "reward_mean": [m["reward_mean"] for m in history]}
    out["overlap_step_time_ratio"] = out["overlap"]["median_s"]["step_s"] / out["sequential"]["median_s"]["step_s"]
    return out


class _Mover:
    """One end of the limit measurement (a Ray actor on a given host)."""

    def put(self, nbytes: int) -> tuple:
        import numpy as np
        import ray

        data = np.ones(nbytes, dtype=np.uint8)
        start = time.perf_counter()
        ref = ray.put(data)
        return [ref], time.perf_counter() - start

    def get(self, wrapped: list) -> float:
        import ray

        start = time.perf_counter()
        value = ray.get(wrapped[0])
        assert value.nbytes > 0
        return time.perf_counter() - start


def limit(loop, nbytes: int, repeats: int) -> dict:
    """Plain ray.put on the trainer's host, ray.get on the engine's host, same bytes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def on(node_id):
        return ray.remote(_Mover).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id, soft=False)).remote()

    src, dst = on(loop.slices[0].devices[0].node_id), on(loop.slices[1].devices[0].node_id)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        wrapped, put_s = ray.get(src.put.remote(nbytes))
        get_s = ray.get(dst.get.remote(wrapped))
        runs.append({"put_s": put_s, "get_s": get_s, "total_s": time.perf_counter() - t0})
        del wrapped
    for actor in (src, dst):
        ray.kill(actor)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def sync_vs_size(name: str, model_dir: str, syncs: int) -> dict:
    from ray_train_tpu.rl import GRPOLoop

    with GRPOLoop(_config(model_dir, tensor_parallel_size=4, check_parity_every=0)) as loop:
        runs = [loop._sync(check=False) for _ in range(syncs)]
        t0 = time.perf_counter()
        blocks = loop.check_parity()
        parity_s = time.perf_counter() - t0
        nbytes = _published_bytes(loop)
        lim = limit(loop, nbytes, syncs)
    med = {k: statistics.median(r[k] for r in runs) for k in ("publish_s", "engine_load_s", "sync_s")}
    return {"model": name, "num_params": loop.num_params, "bytes": nbytes, **med, "parity_s": parity_s,
            "parity_blocks": blocks, "limit": lim, "sync_over_limit_time": med["sync_s"] / lim["total_s"],
            "throughput_vs_limit": lim["total_s"] / med["sync_s"]}


def _published_bytes(loop) -> int:
    import ray

    from ray_train_tpu.rl.weights import unpack

    total = 0
    for part in loop.trainer.call("publish_weights", loop.config.engine_dtype, loop.config.sync_bucket_bytes):
        for bucket in ray.get(part["refs"]):
            total += sum(t.numel() * t.element_size() for _, t in unpack(bucket))
    return total


def overlap_at(model_dir: str, steps: int) -> dict:
    from ray_train_tpu.rl import GRPOLoop

    with GRPOLoop(_config(model_dir, tensor_parallel_size=4, overlap=True, check_parity_every=0)) as loop:
        history = loop.run(steps)[1:]
    return {"num_params": loop.num_params, "steps": len(history), "median_s": _medians(history),
            "sync_fraction_of_step": statistics.median(m["sync_s"] / m["step_s"] for m in history),
            "load_fraction_of_step": statistics.median(m["engine_load_s"] / m["step_s"] for m in history)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [p for p in PHASES if p != "step_s"]
    for i, mode in enumerate(("sequential", "overlap")):
        med = result["phases"][mode]["median_s"]
        ax.bar([j + 0.4 * i for j in range(len(names) + 1)], [med[n] for n in names] + [med["step_s"]], width=0.4,
               label=f"{mode} (step {med['step_s']:.2f} s)")
    ax.set_xticks([j + 0.2 for j in range(len(names) + 1)], [n[:-2] for n in names] + ["step"])
    ax.set_ylabel("median seconds"), ax.legend()
    ax.set_title("GRPO phases, demo model [SIMULATED]")
    sizes = result["sync_vs_size"]
    mb = [s["bytes"] / 2**20 for s in sizes]
    bx.plot(mb, [s["sync_s"] for s in sizes], marker="o", label="weight sync (publish + load)")
    bx.plot(mb, [s["engine_load_s"] for s in sizes], marker=".", ls=":", label="engine load")
    bx.plot(mb, [s["limit"]["total_s"] for s in sizes], color="k", label="limit: ray.put + ray.get, 2 nodes")
    bx.plot(mb, [2 * s["limit"]["total_s"] for s in sizes], color="k", ls="--", label="goal: 2 x limit time")
    bx.set_xscale("log"), bx.set_yscale("log")
    bx.set_xlabel("weights on the wire (MiB, bf16)"), bx.set_ylabel("seconds")
    bx.set_title("weight sync vs size [SIMULATED]"), bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(SIZES[:-1]), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--overlap-steps", type=int, default=5, help="steps of the 100 M model in overlap mode")
    parser.add_argument("--name", default="rl_phases")
    parser.add_argument("--cache", default=None, help="model directory cache (default: a new temporary directory)")
    args = parser.parse_args()

    from ray_train_tpu.rl import models
    from ray_train_tpu.testing import simulated_cluster, simulated_tpu_cluster

    simulated_cluster._OBJECT_STORE_BYTES = OBJECT_STORE_BYTES  # the largest model, twice, per host
    cache = args.cache or tempfile.mkdtemp(prefix="rl_bench_models_")
    sizes = args.sizes.split(",")
    dirs = {name: models.tiny_addition_model(cache, size=name) for name in ["tiny", "bench-100m", *sizes]}
    start = time.perf_counter()
    result = {}
    with simulated_tpu_cluster("2x2x1", "TPU-V4", num_slices=2) as sim:
        _STORAGE["path"] = sim.storage_path
        result["phases"] = phases(dirs["tiny"], args.steps)
        print_phases(result["phases"])
        result["sync_vs_size"] = []
        for name in sizes:
            result["sync_vs_size"].append(sync_vs_size(name, dirs[name], args.syncs))
            print_size(result["sync_vs_size"][-1])
        if args.overlap_steps:
            result["overlap_100m"] = overlap_at(dirs["bench-100m"], args.overlap_steps + 1)
            print(f"[SIMULATED] overlap at 100 M: sync {100 * result['overlap_100m']['sync_fraction_of_step']:.1f}% "
                  f"of a step (load alone {100 * result['overlap_100m']['load_fraction_of_step']:.1f}%)")
    result["wall_s"] = time.perf_counter() - start
    result["environment"] = _common.environment(simulated=True)
    result["goals"] = {"sync throughput >= 0.5 x limit for >= 100 M params": [
        s["throughput_vs_limit"] >= 0.5 for s in result["sync_vs_size"] if s["num_params"] >= 100e6],
        "sync < 10% of a step at 100 M params in overlap mode":
            result.get("overlap_100m", {}).get("sync_fraction_of_step", 1.0) < 0.10}
    path = _common.write(args.name, result)
    plot(result, path.with_suffix(".png"))
    print(f"[SIMULATED] wrote {path} and {path.with_suffix('.png')}; goals {result['goals']}")
    return 0


def print_phases(ph: dict) -> None:
    for mode in ("sequential", "overlap"):
        med = ph[mode]["median_s"]
        print(f"[SIMULATED] {mode}: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in med.items())
              + f"; sync = {100 * ph[mode]['sync_fraction_of_step']:.0f}% of a step", flush=True)
    print(f"[SIMULATED] overlap / sequential step time: {ph['overlap_step_time_ratio']:.2f}", flush=True)


def print_size(s: dict) -> None:
    print(f"[SIMULATED] {s['model']:>11}: {s['num_params'] / 1e6:6.1f} M params, {s['bytes'] / 2**20:7.1f} MiB: sync "
          f"{s['sync_s']:.3f} s (publish {s['publish_s']:.3f}, load {s['engine_load_s']:.3f}); limit "
          f"{s['limit']['total_s']:.3f} s; throughput {s['throughput_vs_limit']:.2f} x limit; parity "
          f"{s['parity_s']:.2f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
