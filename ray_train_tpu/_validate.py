"""One rule, one message: the small validators every public constructor and the CLI use.

Each returns the value it accepted (normalised where that is harmless, e.g. an
``extra_env`` dict copy) or raises ``ValueError`` (``TypeError`` for a
container of the wrong type) with one message style naming the field, the value, the rule and
the fix::

    TPUTorchConfig(timeout_s=-1) must be a finite number of seconds in (0, 604800], got -1; e.g. timeout_s=1800

`where` is the owner as users write it (``"TPUTorchConfig"``); with ``where=""``
the subject is the bare field (``num_slices must be ...``), for functions.

Limits where a value can exhaust the machine come from the largest real pods
(`ray_train_tpu.topology.GENERATIONS`) and are stated in the messages.

Example:
    >>> check_int("TPUScalingConfig", "num_slices", 2, min=1, max=MAX_NUM_SLICES)
    2
    >>> check_int("TPUScalingConfig", "num_slices", 0, min=1, max=4, fix="pass num_slices=1")
    Traceback (most recent call last):
    ...
    ValueError: TPUScalingConfig(num_slices=0) must be an integer in 1..4, got 0; pass num_slices=1
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Union

# Google's largest reported Multislice job ran 199 slices (50,944 TPU v5e chips
# in slices of 256); allow a little more, refuse what only a typo produces.
MAX_NUM_SLICES = 256
MAX_NUM_SLICES_WHY = f"at most {MAX_NUM_SLICES} (the largest reported Multislice job ran 199 slices)"
# A collective or rendezvous that may wait longer than a week is a mistake.
# Devices in one job (every slice together): the same record job had 50,944 chips.
# A plan, a manifest or an env grows with this; past it is a typo, not a job.
MAX_JOB_DEVICES = 65536
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_PORT = 65535
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_ENV_VALUE = 1 << 20  # bytes; Linux allows 128 KiB per string, but a list of 4096 hosts is long


def _subject(where: str, field: str, value: Any) -> str:
    return f"{where}({field}={_short(value)})" if where else field


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"...<{len(text)} characters>"


def fail(where: str, field: str, value: Any, rule: str, fix: Optional[str] = None, *, error=ValueError):
    """The one message: ``<subject> must be <rule>, got <value>; <fix>``."""
    message = f"{_subject(where, field, value)} must be {rule}, got {_short(value)}"
    return error(message + (f"; {fix}" if fix else ""))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(where: str, field: str, value: Any, *, min: Optional[int] = None, max: Optional[int] = None,
              fix: Optional[str] = None, why: Optional[str] = None) -> int:
    """An ``int`` (not a bool) in ``min..max``; `why` explains the bound in the message."""
    if min is not None and max is not None:
        rule = f"an integer in {min}..{max}"
    elif min is not None:
        rule = f"an integer >= {min}"
    elif max is not None:
        rule = f"an integer <= {max}"
    else:
        rule = "an integer"
    rule += f" ({why})" if why else ""
    if not _is_int(value):  # a ValueError, as the counts of Ray and torch have always raised here
        raise fail(where, field, value, rule, fix)
    if (min is not None and value < min) or (max is not None and value > max):
        raise fail(where, field, value, rule, fix)
    return value


def check_number(where: str, field: str, value: Any, *, positive: bool = True, max: Optional[float] = None,
                 unit: str = "", fix: Optional[str] = None) -> float:
    """A finite ``int`` or ``float`` (not a bool), > 0 (or >= 0), at most `max`."""
    low = "(0" if positive else "[0"
    rule = f"a finite number{' of ' + unit if unit else ''}" + (
        f" in {low}, {max:g}]" if max is not None else (" > 0" if positive else " >= 0"))
    if not _is_number(value):
        raise fail(where, field, value, rule, fix)
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or (max is not None and value > max):
        raise fail(where, field, value, rule, fix)
    return value


def check_seconds(where: str, field: str, value: Any, *, fix: Optional[str] = None) -> float:
    """A timeout: finite, > 0 and at most a week."""
    return check_number(where, field, value, max=MAX_TIMEOUT_S, unit="seconds",
                        fix=fix or f"e.g. {field}=1800")


def check_port(where: str, field: str, value: Any, *, span: int = 1, fix: Optional[str] = None) -> int:
    """The one port rule: an integer such that value..value+span-1 are all in 1..65535."""
    top = MAX_PORT - span + 1
    why = None if span == 1 else f"so that {field}..{field}+{span - 1} are ports"
    return check_int(where, field, value, min=1, max=top, why=why, fix=fix or f"pick a free port in 1..{top}")


def check_num_slices(where: str, value: Any, *, field: str = "num_slices", fix: Optional[str] = None) -> int:
    return check_int(where, field, value, min=1, max=MAX_NUM_SLICES, why=None,
                     fix=fix or f"{MAX_NUM_SLICES_WHY}; e.g. {field}=1")


def check_num_slices_range(where: str, value: Any, *, field: str = "num_slices") -> Union[int, tuple[int, int]]:
    """A slice count, or an elastic range ``(min, max)`` of slice counts with
    ``1 <= min <= max``; a list is accepted as a tuple.

    Example:
        >>> check_num_slices_range("TPUScalingConfig", [2, 4])
        (2, 4)
        >>> check_num_slices_range("TPUScalingConfig", (3, 2))
        Traceback (most recent call last):
        ...
        ValueError: TPUScalingConfig(num_slices=(3, 2)) must be a (min, max) range with min <= max, got (3, 2); e.g. num_slices=(2, 3)
    """
    if not isinstance(value, (tuple, list)):
        return check_num_slices(where, value, field=field)
    rule = "an integer or a (min, max) range of integers"
    if len(value) != 2 or not all(_is_int(v) for v in value):
        raise fail(where, field, value, rule, f"e.g. {field}=(2, 4): at least 2 and at most 4 slices")
    low, high = value
    if low < 1:
        raise fail(where, field, tuple(value), "a range of whole slices (min >= 1)",
                   f"a job runs on at least one whole slice; e.g. {field}=(1, {max(high, 1)})")
    if low > high:
        raise fail(where, field, tuple(value), "a (min, max) range with min <= max", f"e.g. {field}=({high}, {low})")
    check_num_slices(where, high, field=f"{field}[1]")
    return (low, high)


def check_bool(where: str, field: str, value: Any, *, fix: Optional[str] = None) -> bool:
    if not isinstance(value, bool):
        raise fail(where, field, value, "True or False", fix, error=TypeError)
    return value


def check_choice(where: str, field: str, value: Any, choices: Iterable[Any], *, fix: Optional[str] = None):
    choices = tuple(choices)
    if value not in choices:
        rule = "one of " + ", ".join(repr(c) for c in choices)
        raise fail(where, field, value, rule, fix, error=ValueError if isinstance(value, str) else TypeError)
    return value


def check_env(where: str, field: str, value: Any) -> dict[str, str]:
    """Environment variables: a mapping of valid names (``[A-Za-z_][A-Za-z0-9_]*``)
    to ``str`` values without NUL, as the OS accepts them. Returns a dict copy."""
    rule = "a dict of environment variable names ([A-Za-z_][A-Za-z0-9_]*) to str values without NUL"
    fix = f"e.g. {field}={{'XLA_FLAGS': '--xla_dump_to=/tmp'}}"
    if not isinstance(value, Mapping):
        raise fail(where, field, value, rule, fix, error=TypeError)
    for name, text in value.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise fail(where, field, value, rule, f"{name!r}: {text!r} is not str: str; {fix}", error=TypeError)
        if not _ENV_NAME.fullmatch(name):
            raise fail(where, field, value, rule, f"{name!r} is not a valid name; {fix}")
        if "\0" in text or len(text) > _MAX_ENV_VALUE:
            raise fail(where, field, value, rule, f"the value of {name} has a NUL or is over 1 MiB; {fix}")
    return dict(value)


def check_resources(where: str, field: str, value: Any) -> dict[str, float]:
    """Ray resources: a mapping of names to non-negative finite numbers. Returns a dict copy."""
    rule = "a dict of resource names (str) to non-negative finite numbers"
    fix = f"e.g. {field}={{'CPU': 2}}"
    if not isinstance(value, Mapping):
        raise fail(where, field, value, rule, fix, error=TypeError)
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise fail(where, field, value, rule, f"{name!r} is not a resource name; {fix}", error=TypeError)
        if not _is_number(amount):
            raise fail(where, field, value, rule, f"{name!r}: {amount!r} is not a number; {fix}", error=TypeError)
        if not math.isfinite(amount) or amount < 0:
            raise fail(where, field, value, rule, f"{name!r}: {amount!r} is negative or not finite; {fix}")
    return dict(value)


def check_job_size(topology: Any, num_slices: int, *, where: str = "", field: str = "num_slices") -> None:
    """At most `MAX_JOB_DEVICES` workers in the job (``num_slices x topology.num_devices``)."""
    total = topology.num_devices * num_slices
    if total > MAX_JOB_DEVICES:
        limit = max(1, MAX_JOB_DEVICES // topology.num_devices)
        raise fail(where, field, num_slices,
                   f"at most {limit} for {topology.accelerator_type} {topology.name} "
                   f"({topology.num_devices} devices a slice): a job has at most {MAX_JOB_DEVICES} devices "
                   "(the largest reported Multislice job had 50,944 chips)",
                   f"e.g. {field}={min(limit, num_slices)}")
