"""What every benchmark records beside its numbers: versions, machine, commit, simulation."""

from __future__ import annotations

import json
import os

# Before anything imports torch: libtpu must never query the cloud metadata
# server here, and torch must not autoload torch_tpu.
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
import math
import platform
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# Student's t, 0.975 quantile, for 1..30 degrees of freedom (the table every statistics text prints).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def geo_mean_ci(ratios: list) -> dict | None:
    """Geometric mean of paired ratios and its 95% t-interval (on logs); None
    with fewer than two ratios."""
    logs = [math.log(r) for r in ratios if r and r > 0]
    if len(logs) < 2:
        return None
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = _T975[min(len(logs) - 1, len(_T975)) - 1] * sd / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "ci95": [math.exp(mean - half), math.exp(mean + half)], "pairs": len(logs),
            "per_pair": [math.exp(x) for x in logs]}


def environment(simulated: bool) -> dict:
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except Exception:
        commit = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    return {
        "simulated": simulated,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None,
        "commit": commit,
        "versions": {m: version(m) for m in ("ray", "torch", "torchdata")},
        "cpu": cpu_info(),
    }


def cpu_info() -> dict:
    """CPU model and flags (results differ by CPU; the VM may hide some flags)."""
    model, flags = None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    isa = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return {"model": model, "isa": isa, "flags": " ".join(flags)}


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def ship_to_ray_workers(*modules) -> None:
    """Ray workers cannot import benchmarks/: pickle these modules' functions by
    value (a module run as __main__ is pickled by value already)."""
    import ray.cloudpickle

    for module in modules:
        if module.__name__ != "__main__":
            ray.cloudpickle.register_pickle_by_value(module)


def serving_model_dir(model: str) -> str:
    """The serving benchmarks' ``--model``: ``smollm2`` (packaged), ``tiny`` (made
    once in the temp dir), or a directory or Hugging Face id as given."""
    import tempfile

    from ray_train_tpu.serve import save_tiny_model, smollm2_dir

    if model == "smollm2":
        return smollm2_dir()
    if model == "tiny":
        return save_tiny_model(os.path.join(tempfile.gettempdir(), "ray_train_tpu-tiny-model"))
    return model
