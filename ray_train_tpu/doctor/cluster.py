"""Talking to the cluster: where it is, connecting fast or failing, probing every TPU host at once."""

from __future__ import annotations

import logging
import re
import sys
from typing import Optional

from ray_train_tpu import _environ
from ray_train_tpu import _validate as V
from ray_train_tpu import constants as C
from ray_train_tpu.doctor.checks import diagnose, tpu_hosts
from ray_train_tpu.doctor.probe import probe_host

# Where Ray looks for a cluster when no address is given.
RAY_ADDRESS = C.RAY_ADDRESS
DEFAULT_TIMEOUT_S = 30.0
_CONNECT_TIMEOUT_S = 5.0

_ADDRESS = re.compile(r"(?P<scheme>ray://)?(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})")


def resolve_address(address: Optional[str]) -> str:
    """``--address``, else ``$RAY_ADDRESS``, else ``"auto"``; checked for form."""
    value = address if address is not None else (_environ.get(RAY_ADDRESS) or "auto")
    value = value.strip()
    m = _ADDRESS.fullmatch(value)
    if value != "auto" and not (m and 0 < int(m["port"]) < 65536):
        source = "--address" if address is not None else f"${RAY_ADDRESS}"
        raise ValueError(f"{source} {value!r} is not a Ray cluster address; expected host:port (the GCS, "
                         "e.g. 10.0.0.2:6379), ray://host:port, or auto")
    return value


def connect(address: str) -> None:
    """``ray.init`` a driver, failing fast (ValueError) when nothing listens at `address`."""
    import socket

    import ray

    m = _ADDRESS.fullmatch(address)
    if m:  # Ray itself retries a dead address for minutes
        try:
            socket.create_connection((m["host"].strip("[]"), int(m["port"])), timeout=_CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise ValueError(f"cannot connect to Ray at {address}: {e.strerror or e}; is the cluster up?") from None
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as e:  # ConnectionError, RuntimeError, ...: one line for the CLI
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot connect to Ray at {address}: {first}") from None


def probe_hosts(hosts: list[dict], timeout_s: float) -> dict[str, dict]:
    """Run `probe_host` on every host at once, each pinned to its node; answers by node id.
    A host that does not answer within `timeout_s` gets ``{"error", "timed_out": True}``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(probe_host)
    refs = {
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(h["node_id"], soft=False),
            name=f"ray_train_tpu.doctor {h['ip']}",
        ).remote(): h["node_id"]
        for h in hosts
    }
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    answers = {}
    for ref in ready:
        try:
            answers[refs[ref]] = ray.get(ref)
        except Exception as e:  # the task raised, or its worker died
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            answers[refs[ref]] = {"error": f"failed: {lines[-1].strip() if lines else type(e).__name__}",
                                  "timed_out": False}
    for ref in pending:
        answers[refs[ref]] = {"error": f"did not answer within {timeout_s:g} s", "timed_out": True}
        try:
            ray.cancel(ref, force=True)
        except Exception:  # best effort; ray.shutdown follows
            pass
    return answers


def run_doctor(address: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Connect (unless this process already is), check every TPU host, return `diagnose`'s report."""
    V.check_seconds("", "timeout", timeout_s, fix="pass e.g. --timeout 30")
    owns = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    if owns:
        address = resolve_address(address)  # before importing Ray: bad input fails fast
        connect(address)
    import ray

    try:
        nodes = ray.nodes()
        report = diagnose(nodes, probe_hosts(tpu_hosts(nodes), timeout_s))
    finally:
        if owns:
            ray.shutdown()
    return {"address": address, **report}
