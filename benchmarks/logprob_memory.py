"""Peak host memory of the trainer's token log-probs: the naive path against the chunked head.

The question: at Qwen's vocabulary (V = 151,936) and 8 rows x 2048 tokens, how
much memory does computing the sampled tokens' log-probs and their gradient
take (forward + backward, temperature 0.7, float32 as the trainer's master
weights)?

- ``naive``: ``grpo.token_logprobs(hidden @ W.T, ids)`` under autograd, the path
  of a model returning its whole logits: the ``[B, T, V]`` float32 logits, their
  scaled copy and ``log_softmax`` (kept for the backward) all exist at once.
- ``chunked``: ``grpo.chunked_token_logprobs(hidden, W, ids, chunk_size=512)``,
  what `PolicyWorker` runs (``AlgorithmConfig.logprob_chunk``): at most 512
  tokens' logits exist at once; the backward recomputes them.

Each (path, T) runs in a fresh subprocess. Its peak RSS (``ru_maxrss``) is taken
after the inputs exist and after forward + backward; the figure is the growth,
with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed large blocks leave RSS at once.
The hidden size is 64 (``--hidden``): it sets only the head's weight (V x H) and
the FLOPs, not the ``B x T x V`` terms that make the difference.

The naive path at T = 2048 needs ~30 GB, more than this 24 GB machine shared by
other jobs can give: it is measured at T = 64, 128, 256 and its 2048 figure is a
linear fit in T of those (labelled ``extrapolated``); the chunked path is
measured at every T, 2048 included. Goal: chunked <= 25% of naive at 2048.

Writes benchmarks/results/logprob_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VOCAB = 151_936
ROWS = 8
GOAL = 0.25


def _measure(path: str, width: int, hidden: int, chunk: int) -> dict:
    """Runs in the subprocess: peak RSS growth of one forward + backward."""
    import resource

    import torch

    from ray_train_tpu.rl import grpo

    torch.set_num_threads(max(1, os.cpu_count() // 2))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(ROWS, width, hidden, generator=g, requires_grad=True)
    w = (torch.randn(VOCAB, hidden, generator=g) / hidden ** 0.5).requires_grad_()
    ids = torch.randint(0, VOCAB, (ROWS, width), generator=g)
    upstream = torch.randn(ROWS, width, generator=g)

    def rss_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    before = rss_mib()
    if path == "naive":
        lp = grpo.token_logprobs(h @ w.T, ids, 0.7)
    else:
        lp = grpo.chunked_token_logprobs(h, w, ids, 0.7, chunk_size=chunk)
    (lp * upstream).sum().backward()
    peak = rss_mib()
    return {"path": path, "tokens": width, "peak_growth_mib": round(peak - before, 1),
            "inputs_mib": round((h.numel() + w.numel()) * 4 / 2**20, 1),
            "logits_f32_mib": round(ROWS * width * VOCAB * 4 / 2**20, 1),
            "checksum": float(lp.detach().double().sum())}


def _run(path: str, width: int, hidden: int, chunk: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "TPU_SKIP_MDS_QUERY": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import json, sys; sys.path.insert(0, {root!r}); from benchmarks.logprob_memory import _measure; "
            f"print(json.dumps(_measure({path!r}, {width}, {hidden}, {chunk})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fit(points: list[tuple[int, float]], at: int) -> float:
    """Least-squares line through (T, MiB), evaluated at ``at``."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my + slope * (at - mx)


def main(argv=None) -> dict:
    from benchmarks._common import environment, write

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--naive-tokens", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512)
    args = p.parse_args(argv)

    rows = []
    for width in args.naive_tokens:
        for path in ("naive", "chunked"):
            rows.append(_run(path, width, args.hidden, args.chunk))
            print(rows[-1], flush=True)
    rows.append(_run("chunked", args.tokens, args.hidden, args.chunk))
    print(rows[-1], flush=True)
    naive = [(r["tokens"], r["peak_growth_mib"]) for r in rows if r["path"] == "naive"]
    naive_at = _fit(naive, args.tokens)
    chunked_at = rows[-1]["peak_growth_mib"]
    largest = max(args.naive_tokens)
    measured_pair = {r["path"]: r["peak_growth_mib"] for r in rows if r["tokens"] == largest}
    payload = {
        "question": f"peak host memory of token log-probs + backward, V={VOCAB}, {ROWS} x {args.tokens} tokens",
        "rows": ROWS, "vocab": VOCAB, "hidden": args.hidden, "chunk_tokens": args.chunk, "temperature": 0.7,
        "dtype": "float32", "measurements": rows,
        "at_tokens": {"tokens": args.tokens, "chunked_mib": chunked_at, "naive_mib_extrapolated": round(naive_at, 1),
                      "ratio": round(chunked_at / naive_at, 4), "goal": GOAL, "met": chunked_at / naive_at <= GOAL,
                      "naive_how": f"linear fit in T of the naive path measured at T = {args.naive_tokens}"},
        "measured_pair": {"tokens": largest, **measured_pair,
                          "ratio": round(measured_pair["chunked"] / measured_pair["naive"], 4)},
        "environment": environment(simulated=False),
    }
    write("logprob_memory", payload)
    print(json.dumps({k: payload[k] for k in ("at_tokens", "measured_pair")}, indent=1))
    return payload


if __name__ == "__main__":
    main()
