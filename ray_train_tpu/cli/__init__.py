"""``python -m ray_train_tpu <command>``: plan, demo, doctor, kuberay, serve.

Bad input is one line on stderr and exit status 2, never a traceback.

Every module of this package whose name does not start with ``_`` is a
command: it has ``register(subparsers, add_slice_args)``, which adds its parser
and sets ``func(args, out) -> exit status``. A new command is one new file.
Command modules must not import Ray or torch at module level, so that ``plan``
stays fast.
"""

from __future__ import annotations

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


def _build_parser() -> Parser:
    parser = Parser(prog="python -m ray_train_tpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in command_modules():
        module.register(sub, add_slice_args)
    return parser


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        func: Callable = args.func
        return func(args, out)
    except (UsageError, ValueError, TypeError) as e:
        err.write(f"ray_train_tpu: error: {e}\n")
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except BrokenPipeError:  # e.g. piped into `head`
        return 0
