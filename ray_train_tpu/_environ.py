"""The one place that reads and writes ``os.environ``; everything else gets dicts."""

from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """The value of one variable of this process."""
    return os.environ.get(name, default)


def snapshot(names: Iterable[str]) -> dict[str, str]:
    """The variables among `names` that are set in this process."""
    return {n: os.environ[n] for n in names if n in os.environ}


def update(values: Mapping[str, str]) -> None:
    """Set variables of this process (and of the processes it starts)."""
    os.environ.update({k: str(v) for k, v in values.items()})


def unset(names: Iterable[str]) -> None:
    for n in names:
        os.environ.pop(n, None)


def copy() -> dict[str, str]:
    """A copy of the whole environment, e.g. for a child process."""
    return dict(os.environ)
