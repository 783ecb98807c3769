"""The package's import graph: no cycles, layers that point one way, and
commands that start without Ray or torch (as Ray's test_circular_imports.py).

Every import counts, also those inside functions and under ``if TYPE_CHECKING:``:
a function-level import is how a cycle hides, and a type-only import still ties
two modules together (``config`` <-> ``_backend`` was one, hidden that way).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "ray_train_tpu"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

# Lowest first. A module may import modules of its own layer or of lower ones,
# never of a higher one: data flows topology -> scaling -> launch_env ->
# backend -> trainer -> strategy, and the tools (doctor, cli, serve) sit on top.
LAYERS: list[tuple[str, ...]] = [
    ("constants", "_environ", "_validate", "_host"),
    ("_compat",),
    ("topology",),
    ("scaling", "launch_env", "mesh", "kuberay"),
    ("discovery",),
    ("device", "throughput", "progress", "examples", "hang"),
    ("strategies", "prepare", "data", "_worker_fns", "_worker", "checkpoint", "huggingface"),
    ("_backend", "config"),
    ("trainer", "actors"),
    ("testing", "doctor"),
    ("cli", "serve", "rl"),
    ("__init__", "__main__"),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules that `name` imports anywhere: at module level, inside
    functions and classes, and under ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from p import m` imports the module p.m; `from p import name`, p itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            # the longest package module that the import names
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(files)
    return {
        name: imports_of(path.read_text(), name, path.name == "__init__.py", modules)
        for name, path in files.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_init(name: str) -> bool:
    return (ROOT.parent / name.replace(".", "/") / "__init__.py").is_file()


def _layer_key(name: str) -> str:
    parts = name.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if dst == PACKAGE:
                out.append(f"{src} imports the package root {PACKAGE} (lazy public API); import the module")
                continue
            a, b = _layer_key(src), _layer_key(dst)
            if a not in LAYER or b not in LAYER:
                out.append(f"{src} -> {dst}: {a if a not in LAYER else b!r} has no layer in LAYERS")
            elif LAYER[b] > LAYER[a]:
                out.append(f"{src} (layer {LAYER[a]}) imports {dst} (layer {LAYER[b]}), a higher layer")
    return out


def test_the_graph_sees_function_level_and_relative_imports():
    modules = {"p", "p.a", "p.b", "p.sub", "p.sub.c"}
    source = "import os\nfrom p import a\ndef f():\n    from p.sub import c\n    from . import b\n"
    assert imports_of(source, "p.x", False, modules) == {"p.a", "p.sub.c", "p.b"}
    assert imports_of("from p.sub import name\n", "p.x", False, modules) == {"p.sub"}
    hidden = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\nclass K:\n    def m(self):\n        import p.b\n"
    assert imports_of(hidden, "p.x", False, modules) == {"p.a", "p.b"}


def test_the_graph_of_todays_modules_has_each_kind_of_import():
    """The finder sees the real package's function-level and TYPE_CHECKING edges."""
    graph = import_graph()
    assert "ray_train_tpu.topology" in graph["ray_train_tpu.mesh"]  # only under TYPE_CHECKING there
    assert "ray_train_tpu.strategies" in graph["ray_train_tpu.prepare"]  # only inside functions there


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles (function-level imports count): {found}"


def test_layers_point_one_way():
    graph = import_graph()
    # the package root is a lazy facade; importing it from inside the package
    # hides which module a name comes from. Demo and example code that run in
    # workers use the public API as users do, so they may.
    graph = {k: v - {PACKAGE} if k.startswith((f"{PACKAGE}.cli.demo", f"{PACKAGE}.serve")) else v
             for k, v in graph.items()}
    assert not layer_violations(graph), "\n".join(layer_violations(graph))
    assert set(_layer_key(m) for m in graph) <= set(LAYER), set(_layer_key(m) for m in graph) - set(LAYER)


@pytest.mark.parametrize("argv", [
    ["plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4", "--format", "json"],
    ["kuberay", "--topology", "4x4", "--accelerator-type", "TPU-V6E", "--format", "json"],
    ["--help"],
])
def test_light_commands_start_without_ray_or_torch(argv):
    code = (
        "import io, sys; from ray_train_tpu.cli import main; "
        f"rc = main({argv!r}, out=io.StringIO()); "
        "heavy = sorted(m for m in ('ray', 'torch', 'torch_tpu') if m in sys.modules); "
        "print(rc, heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "0 []", done.stdout + done.stderr


def test_a_ddp_worker_starts_without_fsdp_or_dtensor():
    """Every Ray Train worker, at every (elastic) restart, unpickles the run's
    TPUTorchConfig with its strategy and imports the functions the backend runs
    before the training function: for DDP that must not import torch's FSDP and
    DTensor modules (with sympy: ~0.65 s of CPU per worker) that only FSDP2 and
    tensor parallelism use."""
    import pickle

    from ray_train_tpu import TPUScalingConfig, TPUTorchConfig
    from ray_train_tpu.strategies.ddp import DDPStrategy

    blob = pickle.dumps((TPUTorchConfig(strategy=DDPStrategy()), TPUScalingConfig(topology="2x2x2",
                                                                                  accelerator_type="TPU-V4")))
    heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "sympy")
    code = (
        "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1])); "
        "import ray_train_tpu._worker_fns, ray_train_tpu.prepare, ray_train_tpu.hang, "
        "ray_train_tpu.checkpoint.preemption; from ray_train_tpu.strategies import get_strategy, DDPStrategy; "
        "get_strategy('ddp'); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code, blob.hex()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[] True", done.stdout + done.stderr
