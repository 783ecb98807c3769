"""The demo command's argument checks (the demo itself runs in `make demo`)."""

import io

from ray_train_tpu.cli import main


def test_demo_rejects_bad_input_before_starting_anything():
    err = io.StringIO()
    assert main(["demo", "--topology", "4x5"], out=io.StringIO(), err=err) == 2
    assert "valid: 1x1" in err.getvalue()
    err = io.StringIO()
    assert main(["demo", "--steps", "0"], out=io.StringIO(), err=err) == 2
    assert "--steps must be an integer in 1..100000, got 0" in err.getvalue()


def test_demo_is_quiet_unless_verbose(monkeypatch):
    """Ray's per-report INFO lines are off by default; --verbose or
    RAY_TRAIN_TPU_VERBOSE=1 bring them back (the run itself: tests/distributed/
    test_docs_examples_on_slice.py::test_demo_output_is_quiet)."""
    import argparse
    import logging

    from ray_train_tpu.cli import demo

    monkeypatch.delenv("RAY_TRAIN_TPU_VERBOSE", raising=False)
    assert not demo.is_verbose(argparse.Namespace(verbose=False))
    assert demo.is_verbose(argparse.Namespace(verbose=True))
    assert demo.run_config("/tmp/x", verbose=False).logging_config.log_level == "WARNING"
    assert demo.run_config("/tmp/x", verbose=True).logging_config.log_level == "INFO"  # Ray's default
    monkeypatch.setenv("RAY_TRAIN_TPU_VERBOSE", "1")
    assert demo.is_verbose(argparse.Namespace(verbose=False))

    # Ray Train logs its per-report line through a logger named by its file's path,
    # which takes its level from the root logger: what quiet_logs() raises.
    root = logging.getLogger()
    before = root.level
    ray_like = logging.getLogger("/site-packages/ray/train/v2/_internal/execution/context.py")
    try:
        assert ray_like.isEnabledFor(logging.INFO) or before > logging.INFO
        demo.quiet_logs()
        assert not ray_like.isEnabledFor(logging.INFO) and ray_like.isEnabledFor(logging.WARNING)
    finally:
        root.setLevel(before)


def test_demo_help_names_the_verbose_flag(capsys):
    assert main(["demo", "-h"], out=io.StringIO(), err=io.StringIO()) == 0
    assert "--verbose" in capsys.readouterr().out


def test_a_failure_while_the_demo_runs_is_exit_1_naming_the_demo(monkeypatch):
    """A ValueError raised while running (here: from the cluster's start) is the
    demo's failure, exit 1 with what failed, not "bad input" (exit 2)."""
    import contextlib

    import ray_train_tpu.testing

    @contextlib.contextmanager
    def no_cluster(*args, **kwargs):
        raise ValueError("deep inside Ray: a node could not start")
        yield  # pragma: no cover

    monkeypatch.setattr(ray_train_tpu.testing, "simulated_tpu_cluster", no_cluster)
    err = io.StringIO()
    assert main(["demo", "--steps", "1"], out=io.StringIO(), err=err) == 1
    lines = err.getvalue().splitlines()
    assert lines[0] == "ray_train_tpu: error: the demo failed:", lines
    assert any("a node could not start" in line for line in lines)


def test_the_cli_writes_to_sys_stdout_as_it_is_when_called(capsys):
    """Not the sys.stdout of import time: a redirect (or a test's capture) made
    later must get the output."""
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--topology", "2x2x1", "--accelerator-type", "TPU-V4"]) == 0
    assert "v4-8" in buf.getvalue() and "v4-8" not in capsys.readouterr().out
