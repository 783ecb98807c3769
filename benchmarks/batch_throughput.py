"""Rows/s and output tokens/s of batch inference on slices (Ray Data LLM's vLLM
engine, one engine per slice: `ray_train_tpu.serve.batch`) against vLLM
offline with the same engines (one ``vllm.LLM`` process per slice, each given
its share of the prompts), in the same run.

Goal (issues 29, 33): batch >= 0.9x offline, in rows/s and output tokens/s,
judged on the geometric mean over pairs (with its 95% t-interval) of the whole
job (engines started, every prompt answered: what a user waits for; the cluster
is up already). Each batch job runs from a driver process of its own, as a
user's script does and as each offline process does: from its launch (Ray
connected, Ray Data LLM's processor built; vLLM is imported by the engines
only) to its last row. Also reported: the rate while every engine works (offline: from a
common start once every engine is up; batch: from the moment every slice has
returned a row, which counts work done before that moment and so favours
batch). Runs are paired and counterbalanced (offline, batch, batch, offline,
...), one ratio per pair. Default: SmolLM2-135M-Instruct (float32) on two
simulated one-chip v6e slices, 400 prompts of 32 tokens (``ignore_eos``: equal
work everywhere). SIMULATED: CPU kernels, not TPU numbers; on a shared 2-core
machine the absolute rates are noisy, the ratios less so.

Writes benchmarks/results/batch_throughput.json (+ .png with matplotlib).
Starts a simulated cluster: run it under ``flock /tmp/rtt-sim.lock`` here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, geo_mean_ci, serving_model_dir, write  # noqa: E402

NAME = "batch_throughput"
GOAL = 0.9
TOPICS = ["the sea", "a mountain", "the city at night", "a library", "autumn", "a train journey", "the moon",
          "a market", "rain", "a garden", "the desert", "a lighthouse", "snow", "a bridge", "the forest", "a river"]

_OFFLINE = """
import json, os, sys, time
t_launch = time.time()
model, prompts, max_tokens, engine, ready, go = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model, tensor_parallel_size=1, **engine)
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, as the batch engines' first batch
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.05)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t0
print("RESULT " + json.dumps({"rows": len(outs), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                              "wall_s": wall, "launched": t_launch, "done": time.time()}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="'smollm2' (packaged), 'tiny' (random) or a directory")
    p.add_argument("--topology", default="1x1")
    p.add_argument("--accelerator-type", default="TPU-V6E")
    p.add_argument("--num-slices", type=int, default=2, help="engines, one per slice (and offline processes)")
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="rows per batch sent to a batch engine")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--pairs", type=int, default=2, help="paired runs (offline, batch), counterbalanced")
    p.add_argument("--out", default=NAME, help="results/<out>.json")
    args = p.parse_args(argv)
    for name in ("num_slices", "prompts", "max_tokens", "batch_size", "pairs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompts < 4 * args.num_slices:
        p.error(f"--prompts {args.prompts} must be at least 4 per slice ({4 * args.num_slices})")
    return args


def prompts(n: int) -> list[str]:
    return [f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def engine_kwargs(args) -> dict:
    return {"dtype": args.dtype, "enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": 128 * 2**20,
            "max_num_seqs": 64}


def steady_rate(arrivals: list[tuple[float, str, int]], num_slices: int) -> dict:
    """Rows and tokens per second from the moment every slice has returned a row
    (``arrivals``: (time, slice, tokens) per row, in arrival order)."""
    seen, start = set(), None
    for i, (t, s, _) in enumerate(arrivals):
        seen.add(s)
        if len(seen) == num_slices:
            start = i
            break
    if start is None or start == len(arrivals) - 1:
        return {"rows": 0, "tokens": 0, "wall_s": 0.0, "rows_per_s": None, "tokens_per_s": None}
    t0, t1 = arrivals[start][0], arrivals[-1][0]
    rows = len(arrivals) - start - 1
    tokens = sum(tok for _, _, tok in arrivals[start + 1:])
    return {"rows": rows, "tokens": tokens, "wall_s": t1 - t0, "rows_per_s": rows / (t1 - t0),
            "tokens_per_s": tokens / (t1 - t0)}


def summarize(pairs: list[tuple[dict, dict]]) -> dict:
    """Batch/offline over the pairs, for the whole job (the goal) and while every
    engine works: the median, and the geometric mean with its 95% t-interval."""
    def ratios(part, key):
        return sorted(b[part][key] / o[part][key] for b, o in pairs if b[part].get(key) and o[part].get(key))

    def median(found):
        if not found:
            return None
        mid = len(found) // 2
        return found[mid] if len(found) % 2 else (found[mid - 1] + found[mid]) / 2

    out = {"goal": GOAL, "pairs": len(pairs)}
    for part in ("job", "steady"):
        for key in ("rows_per_s", "tokens_per_s"):
            found = ratios(part, key)
            out[f"{part}_batch_vs_offline_{key}"], out[f"{part}_{key}_ratios"] = median(found), found
            ci = geo_mean_ci(found)
            out[f"{part}_{key}_geomean"] = ci and ci["ratio"]
            out[f"{part}_{key}_ci95"] = ci and ci["ci95"]
    rows, tokens = out["job_rows_per_s_geomean"], out["job_tokens_per_s_geomean"]
    out["meets_goal"] = bool(rows and tokens and rows >= GOAL and tokens >= GOAL)
    lows = [out["job_rows_per_s_ci95"], out["job_tokens_per_s_ci95"]]
    out["meets_goal_at_95"] = bool(all(lows) and all(ci[0] >= GOAL for ci in lows))
    return out


_BATCH = """
import json, sys, time
t_launch = time.time()
address, model, prompts, topology, accel, num_slices, max_tokens, batch_size, engine = json.loads(sys.argv[1])
import ray
ray.init(address=address)
from ray_train_tpu.serve.batch import BatchConfig, SliceBatchProcessor
config = BatchConfig(model=model, topology=topology, accelerator_type=accel, num_slices=num_slices,
                     max_tokens=max_tokens, batch_size=batch_size, sampling_params={"ignore_eos": True},
                     engine_kwargs=engine)
ds = ray.data.from_items([{"prompt": t} for t in prompts], override_num_blocks=max(1, len(prompts) // batch_size))
arrivals = []
with SliceBatchProcessor(config) as processor:
    for row in processor(ds).iter_rows():
        arrivals.append((time.time(), row["slice"], int(row["num_generated_tokens"])))
print("RESULT " + json.dumps({"launched": t_launch, "arrivals": arrivals}))
"""


def run_batch(args, model_dir: str, texts: list[str], address: str) -> dict:
    """One batch job, from a driver process of its own (as a user's script is,
    and as each offline process is): from its launch to its last row."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RAY_TRAIN_TPU_SIMULATE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    arg = json.dumps([address, model_dir, texts, args.topology, args.accelerator_type, args.num_slices,
                      args.max_tokens, args.batch_size, engine_kwargs(args)])
    proc = subprocess.run([sys.executable, "-c", _BATCH, arg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"batch driver failed (exit status {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    t0, arrivals = result["launched"], [tuple(a) for a in result["arrivals"]]
    wall = arrivals[-1][0] - t0
    rows, tokens = len(arrivals), sum(a[2] for a in arrivals)
    first = {}
    for t, s, _ in arrivals:
        first.setdefault(s, t - t0)
    out = {"job": {"rows": rows, "tokens": tokens, "wall_s": wall, "rows_per_s": rows / wall,
                   "tokens_per_s": tokens / wall},
           "steady": steady_rate(arrivals, args.num_slices), "first_row_s_by_slice": first}
    print("batch", out, flush=True)
    return out


def run_offline(args, model_dir: str, texts: list[str]) -> dict:
    """One vLLM process per slice, each with its share, started together."""
    tmp = tempfile.mkdtemp(prefix="batch-bench-")
    go = os.path.join(tmp, "go")
    env = {**os.environ, "RAY_TRAIN_TPU_SIMULATE": "1"}
    procs, ready = [], []
    for i in range(args.num_slices):
        ready.append(os.path.join(tmp, f"ready-{i}"))
        arg = json.dumps([model_dir, texts[i::args.num_slices], args.max_tokens, engine_kwargs(args), ready[-1], go])
        procs.append(subprocess.Popen([sys.executable, "-c", _OFFLINE, arg], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, env=env))
    while not all(os.path.exists(r) for r in ready):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("an offline vLLM process exited before it was ready")
        time.sleep(0.2)
    open(go, "w").close()
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"offline vLLM process failed (exit status {p.returncode})")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    wall = max(r["wall_s"] for r in results)
    job = max(r["done"] for r in results) - min(r["launched"] for r in results)
    rows, tokens = sum(r["rows"] for r in results), sum(r["tokens"] for r in results)
    out = {"job": {"rows": rows, "tokens": tokens, "wall_s": job, "rows_per_s": rows / job, "tokens_per_s": tokens / job},
           "steady": {"rows": rows, "tokens": tokens, "wall_s": wall, "rows_per_s": rows / wall,
                      "tokens_per_s": tokens / wall},
           "per_engine": results}
    print("offline", out, flush=True)
    return out


def plot(pairs: list, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2))
    for ax, part, title in ((axes[0], "job", "whole job (goal)"), (axes[1], "steady", "while every engine works")):
        for i, (b, o) in enumerate(pairs):
            ax.bar([i - 0.2], [b[part]["tokens_per_s"] or 0], 0.4, color="tab:blue", label="batch (Ray Data LLM)" if i == 0 else None)
            ax.bar([i + 0.2], [o[part]["tokens_per_s"] or 0], 0.4, color="tab:gray", label="vLLM offline" if i == 0 else None)
        ax.set_xticks(range(len(pairs)), [f"pair {i + 1}" for i in range(len(pairs))])
        ax.set_ylabel("output tokens/s")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("Batch inference, same engines (SIMULATED slices, CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("RAY_TRAIN_TPU_SIMULATE", "1")  # this process imports vLLM too
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # Ray gives the batch engines' vLLM workers (zero-CPU actors) OMP_NUM_THREADS=1;
    # the offline processes get the same, or the comparison is of thread counts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = serving_model_dir(args.model)
    texts = prompts(args.prompts)
    from ray_train_tpu.testing import simulated_tpu_cluster

    pairs = []
    with simulated_tpu_cluster(args.topology, args.accelerator_type, num_slices=args.num_slices) as sim:
        for i in range(args.pairs):  # offline first in even pairs, batch first in odd ones
            if i % 2 == 0:
                offline = run_offline(args, model_dir, texts)
                batch = run_batch(args, model_dir, texts, sim.address)
            else:
                batch = run_batch(args, model_dir, texts, sim.address)
                offline = run_offline(args, model_dir, texts)
            pairs.append((batch, offline))
    summary = summarize(pairs)
    payload = {
        "benchmark": NAME,
        "question": "rows/s and output tokens/s of batch inference on slices vs vLLM offline, same engines",
        "config": {**vars(args), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "model": model_dir,
        "pairs": [{"batch": b, "offline": o} for b, o in pairs],
        "summary": summary,
        "environment": environment(simulated=True),
    }
    path = write(args.out, payload)
    plot(pairs, path.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
