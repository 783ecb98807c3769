"""Export time and peak host memory per process: `export_hf` against gathering the model in one process.

For each model size (random Llamas of the weight-sync benchmark's shapes,
float32), a sharded checkpoint is written by 2 gloo ranks on CPU with FSDP2
(``fully_shard`` per decoder layer), then exported three ways, each in fresh
processes:

- ``gather`` (the baseline users write): one process builds the model from the
  base directory, `checkpoint.load`s the whole checkpoint into it and calls
  ``save_pretrained``;
- ``export_1``: `export_hf` in one process (the CLI);
- ``export_2``: `export_hf` called on both ranks of a 2-process gloo group.

``export_hf`` runs with ``--max-file-mib`` (default 64) so that files, and
hence peak memory, stay small beside the model; its peak grows by about three times the
largest file, whatever the model size. Peak memory is each process's
``VmHWM`` (the high-water mark of its RSS), also as the growth over the RSS before the export started
(imports of torch and transformers are in the baseline). Export time is the
call alone (not the interpreter start, nor the imports both ways share, done first). Everything runs on the host CPU: the
numbers are the same on a TPU VM's host in kind, not in value.

With ``--vllm`` (instead): a 10m model (initialised with a wide spread, so that
greedy choices are clear) is checkpointed by 2 FSDP2 ranks, exported, and
loaded by vLLM (CPU, in a subprocess); its greedy tokens are compared with
transformers' on the same directory: benchmarks/results/export_vllm.json.

Writes benchmarks/results/export.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import environment, write  # noqa: E402  (sets TPU_SKIP_MDS_QUERY first)

SIZES = {  # as ray_train_tpu.rl.models' bench-* sizes (vocab 32000, untied)
    "10m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=8),
    "100m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16),
    "200m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16),
}
VOCAB = 8000


def _rss_mib() -> float:
    """This process's peak RSS: ``VmHWM``, the high-water mark of its own address space. (Not
    ``ru_maxrss``: Linux carries it over fork and exec, so a process started by a big parent
    reports the parent's RSS as its own peak.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_base(path: Path, size: str, initializer_range: float = 0.02) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ray_train_tpu.rl.models import _tokenizer

    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=False, dtype="float32",
                      initializer_range=initializer_range,
                      num_key_value_heads=SIZES[size]["num_attention_heads"], **SIZES[size])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _write_checkpoint(rank, world, base, ckpt):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from ray_train_tpu import checkpoint

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)  # not the base model's weights
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    checkpoint.save(ckpt, model=model, step=1)


def _warm_imports() -> None:
    """What either way imports, before the clock and the RSS baseline start (imports are not the export)."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from ray_train_tpu.checkpoint import export  # noqa: F401


def _export_rank(rank, world, ckpt, base, dest, max_file_bytes):
    from ray_train_tpu.checkpoint import export_hf

    _warm_imports()
    before = _current_rss_mib()
    start = time.perf_counter()
    export_hf(ckpt, base, dest, max_file_bytes=max_file_bytes)
    return {"seconds": time.perf_counter() - start, "peak_rss_mib": _rss_mib(), "rss_before_mib": before}


def one(mode: str, ckpt: str, base: str, dest: str, max_file_bytes: int) -> dict:
    """One process: ``export`` (export_hf) or ``gather`` (load whole, save_pretrained)."""
    import torch  # noqa: F401  (imports count in the baseline RSS of both modes)
    from transformers import AutoModelForCausalLM

    from ray_train_tpu import checkpoint

    if mode == "export":
        return _export_rank(0, 1, ckpt, base, dest, max_file_bytes)
    _warm_imports()
    before = _current_rss_mib()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    checkpoint.load(ckpt, model=model)
    model.save_pretrained(dest)
    return {"seconds": time.perf_counter() - start, "peak_rss_mib": _rss_mib(), "rss_before_mib": before}


def _in_fresh_process(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", *map(str, args)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(rows: list) -> dict:
    return {"seconds": max(r["seconds"] for r in rows),
            "peak_rss_mib_per_process": [round(r["peak_rss_mib"], 1) for r in rows],
            "growth_mib_per_process": [round(r["peak_rss_mib"] - r["rss_before_mib"], 1) for r in rows]}


def bench_size(size: str, work: Path, max_file_bytes: int) -> dict:
    from ray_train_tpu.testing import gloo

    base, ckpt = work / f"base-{size}", work / f"ckpt-{size}"
    params = make_base(base, size)
    gloo.run(_write_checkpoint, 2, str(base), str(ckpt), timeout_s=900)
    row = {"size": size, "params": params, "model_mib": round(params * 4 / 2**20, 1)}
    row["gather"] = _summary([_in_fresh_process("gather", ckpt, base, work / f"gather-{size}", max_file_bytes)])
    row["export_1"] = _summary([_in_fresh_process("export", ckpt, base, work / f"one-{size}", max_file_bytes)])
    row["export_2"] = _summary(gloo.run(_export_rank, 2, str(ckpt), str(base), str(work / f"two-{size}"),
                                        max_file_bytes, timeout_s=900))
    row["same_tensors"] = _same_tensors(work / f"gather-{size}", work / f"one-{size}", work / f"two-{size}")
    print(json.dumps(row), flush=True)
    return row


def _same_tensors(*dirs) -> bool:
    """Every export holds the same tensors, bit for bit (read one file at a time)."""
    import torch
    from safetensors import safe_open

    def index(d):
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    maps = [index(d) for d in dirs]
    if any(sorted(m) != sorted(maps[0]) for m in maps):
        return False
    for name in maps[0]:
        tensors = []
        for m in maps:
            with safe_open(str(m[name]), "pt") as h:
                tensors.append(h.get_tensor(name))
        if not all(torch.equal(tensors[0], t) for t in tensors[1:]):
            return False
    return True


_VLLM = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, prompts, n = json.loads(sys.argv[1])
llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=32 * 2**20)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_handover(work: Path) -> dict:
    from ray_train_tpu.checkpoint import export_hf
    from ray_train_tpu.testing import gloo

    base = work / "base-vllm"
    make_base(base, "10m", initializer_range=0.5)
    gloo.run(_write_checkpoint, 2, str(base), str(work / "ckpt-vllm"), timeout_s=900)
    export_hf(work / "ckpt-vllm", base, work / "export-vllm")
    return vllm_check(work / "export-vllm")


def vllm_check(model_dir: Path, n: int = 12) -> dict:
    """vLLM's greedy tokens on the export against transformers' on the same directory."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [[1, 5, 14, 6, 16, 7], [1, 9, 9, 15, 4, 11], [1, 12, 3, 8, 10, 13]]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "RAY_TRAIN_TPU_SIMULATE": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _VLLM, json.dumps([str(model_dir), prompts, n])], capture_output=True,
                         text=True, env=env)
    seconds = time.perf_counter() - start
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        return {"ok": False, "error": out.stderr[-2000:]}
    vllm_tokens = json.loads(lines[-1][len("RESULT "):])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor(prompts)
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:].tolist()
    return {"ok": True, "equal": hf == vllm_tokens, "vllm": vllm_tokens, "transformers": hf,
            "vllm_process_seconds": round(seconds, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["10m", "100m", "200m"], choices=sorted(SIZES))
    p.add_argument("--max-file-mib", type=int, default=64)
    p.add_argument("--vllm", action="store_true", help="instead: check an export's greedy tokens in vLLM")
    p.add_argument("--one", nargs=5, metavar=("MODE", "CKPT", "BASE", "DEST", "MAX_FILE_BYTES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        mode, ckpt, base, dest, max_file_bytes = args.one
        print(json.dumps(one(mode, ckpt, base, dest, int(max_file_bytes))))
        return 0
    work = Path(tempfile.mkdtemp(prefix="ray_train_tpu-export-bench-"))
    try:
        if args.vllm:
            print(write("export_vllm", {**vllm_handover(work), "environment": environment(simulated=False)}))
            return 0
        rows = [bench_size(size, work, args.max_file_mib << 20) for size in args.sizes]
        result = {"benchmark": "export", "max_file_mib": args.max_file_mib, "rows": rows,
                  "environment": environment(simulated=False),
                  "load_average_at_end": os.getloadavg()}
        print(write("export", result))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
