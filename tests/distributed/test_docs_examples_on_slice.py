"""The docs' examples marked ``<!-- run: simulated slice -->`` run, as written, and
``make demo``'s output is quiet.

One test per page that has such blocks (README.md, docs/*.md; the markers:
tests/docs_examples.py). A page's blocks run in page order in one namespace,
the blocks without a marker included (they define what the others use), up to
its last simulated-slice block. The blocks' own ``simulated_tpu_cluster(...)``
calls get a cluster of this module's: one per set of arguments, started at the
first block that asks for it and kept up until another set is asked for or the
module ends. Runs (measured here, 2 shared cores): README and three docs pages on
one v4 2x2x1 slice (4 workers), then the demo on the same slice.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import re
import time

import pytest

from tests import docs_examples as D

pytestmark = pytest.mark.distributed


class SharedClusters:
    """Stands in for `simulated_tpu_cluster` while the docs' blocks run."""

    def __init__(self, real):
        self._real, self._signature = real, inspect.signature(real)
        self._context, self.key, self.sim = None, None, None
        self.started: list[str] = []

    def __call__(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = repr(sorted(bound.arguments.items()))
        if key != self.key:
            self.close()
            self._context = self._real(*args, **kwargs)
            self.sim, self.key = self._context.__enter__(), key
            self.started.append(key)
        return contextlib.nullcontext(self.sim)

    def close(self) -> None:
        context, self._context, self.key, self.sim = self._context, None, None, None
        if context is not None:
            context.__exit__(None, None, None)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    import ray.train
    import ray.train.constants

    import ray_train_tpu.testing
    import ray_train_tpu.testing.simulated_cluster as sc

    shared = SharedClusters(sc.simulated_tpu_cluster)
    storage = str(tmp_path_factory.mktemp("ray_results"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray_train_tpu.testing, "simulated_tpu_cluster", shared)
        mp.setattr(sc, "simulated_tpu_cluster", shared)
        # Runs without a storage_path (as in the examples) write here, not to ~/ray_results.
        mp.setattr(ray.train.constants, "DEFAULT_STORAGE_PATH", storage)
        assert ray.train.RunConfig().storage_path == storage
        try:
            yield shared
        finally:
            shared.close()


def _pages_on_a_slice() -> list[str]:
    return sorted(page for page, found in D.by_page(D.all_examples()).items() if any(e.kind == D.SLICE for e in found))


@pytest.mark.timeout(300)  # a stuck example must not hold the shared simulation lock for long
@pytest.mark.parametrize("page", _pages_on_a_slice())
def test_examples_on_a_simulated_slice_run(page, clusters, tmp_path, monkeypatch):
    found = D.by_page(D.all_examples())[page]
    last = max(i for i, e in enumerate(found) if e.kind == D.SLICE)
    blocks = [e for e in found[:last + 1] if e.kind in (D.LOCAL, D.SLICE)]
    monkeypatch.chdir(tmp_path)
    ns = D.namespace(page)
    try:
        ran = D.run(blocks, ns)
    finally:
        ns.clear()  # as at the end of a script: actors whose handles are gone exit
        gc.collect()
        _wait_for_free_tpus(page)
    assert ran == [e.where for e in blocks]
    assert clusters.sim is not None, f"no block of {page} asked for a simulated cluster"


def _wait_for_free_tpus(after: str, timeout_s: float = 60.0) -> None:
    """Every TPU of the shared cluster is free again, so that the next page (or the
    demo) is not left waiting for resources that a finished example still holds."""
    import ray

    if not ray.is_initialized():
        return
    total, deadline = ray.cluster_resources().get("TPU", 0), time.monotonic() + timeout_s
    while ray.available_resources().get("TPU", 0) < total:
        assert time.monotonic() < deadline, f"{after} left TPUs held after its examples ended: {ray.available_resources()}"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_demo_output_is_quiet(clusters, capfd):
    """``make demo`` on the slice the examples used: its own line per step, a
    summary, SIMULATED, and none of Ray Train's per-report INFO lines."""
    from ray_train_tpu.cli import main

    _wait_for_free_tpus("the examples")
    _forwarded(capfd, "", settle_s=DEDUP_WINDOW_S)  # the examples' last lines, which Ray may still be holding back
    assert main(["demo", "--topology", "2x2x1", "--accelerator-type", "TPU-V4", "--steps", "3"]) == 0
    out = _forwarded(capfd, "step   3")
    assert "SIMULATED" in out and "trained 3 steps" in out and "demo finished" in out
    # its checkpoint is on storage every host sees, and outlives the cluster (whose host disks are gone)
    (checkpoint,) = re.findall(r"; checkpoint: (\S+)\n", out)
    assert os.path.isfile(os.path.join(checkpoint, "model.pt")), checkpoint
    assert "/hosts/" not in checkpoint, checkpoint
    assert [n for n in (1, 2, 3) if f"[SIMULATED] step   {n}" not in out] == []
    # A late dedup summary ("[repeated Nx across cluster]") of an earlier example's
    # lines may still arrive during the demo; it names that example's worker, not the
    # demo's. Any other such line is the demo's own noise.
    demo_pids = set(re.findall(r"pid=(\d+)\)\S* \[SIMULATED\] step", out))
    assert demo_pids, out
    noise = [line for line in out.splitlines()
             if ("Reporting training result" in line or "Started training worker group" in line)
             and not ("[repeated" in line and set(re.findall(r"pid=(\d+)", line)) - demo_pids)]
    assert noise == [], f"Ray's INFO lines in the demo's output: {noise}"


# Ray's driver folds repeated worker lines and prints the summary ("[repeated 14x
# across cluster]") when its window (RAY_DEDUP_LOGS_AGG_WINDOW_S, 5 s) closes.
DEDUP_WINDOW_S = 6.0


def _forwarded(capfd, last: str, timeout_s: float = 30.0, settle_s: float = DEDUP_WINDOW_S) -> str:
    """Everything printed, including the worker lines Ray forwards to the driver
    later: until `last` has arrived, then `settle_s` more for what Ray holds back."""
    seen, deadline = "", time.monotonic() + timeout_s
    while last not in seen and time.monotonic() < deadline:
        time.sleep(0.5)
        captured = capfd.readouterr()
        seen += captured.out + captured.err
    time.sleep(settle_s)
    captured = capfd.readouterr()
    return seen + captured.out + captured.err
