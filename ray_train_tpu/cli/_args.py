"""What every command shares: the parser that never exits by itself, and the slice arguments."""

from __future__ import annotations

import argparse
from typing import Optional

from ray_train_tpu.topology import GENERATIONS


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit itself
        raise UsageError(message)


def add_slice_args(
    p: argparse.ArgumentParser,
    *,
    topology: Optional[str] = None,
    accelerator_type: Optional[str] = None,
    num_slices: bool = True,
) -> None:
    """``--topology``, ``--accelerator-type`` (required unless given a default) and ``--num-slices``."""
    p.add_argument(
        "--topology", required=topology is None, default=topology,
        help='slice mesh in chips, e.g. "4x4" or "2x2x2"' + (f" (default {topology})" if topology else ""),
    )
    p.add_argument(
        "--accelerator-type", required=accelerator_type is None, default=accelerator_type,
        help=f"one of {', '.join(GENERATIONS)}" + (f" (default {accelerator_type})" if accelerator_type else ""),
    )
    if num_slices:
        p.add_argument("--num-slices", type=int, default=1, help="slices in the job (default 1)")
