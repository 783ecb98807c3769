"""rl-demo's command line: bad input before anything starts, labelled output, imports without torch."""

import io
import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"), (["--samples", "1"], "--samples must be >= 2"),
    (["--temperature", "0"], "--temperature must be > 0"), (["--tp", "0"], "--tp must be >= 1"),
    (["--engines", "0"], "--engines must be >= 1"), (["--minibatches", "0"], "--minibatches must be >= 1"),
])
def test_rl_demo_rejects_bad_input_before_starting_anything(argv, message):
    from ray_train_tpu.cli import main

    err = io.StringIO()
    assert main(["rl-demo", *argv], out=io.StringIO(), err=err) == 2
    assert message in err.getvalue()


def test_cli_and_package_import_without_torch():
    code = ("import sys, ray_train_tpu.rl, ray_train_tpu.rl.cli, ray_train_tpu.rl.config, ray_train_tpu.cli; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _fake_history(n):
    return [{"step": i + 1, "reward_mean": 0.1 * i, "reward_std": 0.05, "reward_min": 0.0, "reward_max": 1.0,
             "exact": 0.05 * i, "rollout_s": 0.2, "reward_s": 0.001, "train_s": 0.3, "checkpoint_s": 0.0,
             "sync_s": 0.05, "parity_s": 0.01, "step_s": 0.6, "parity_checked": True, "rollout_retries": i == 2,
             "resumed_from": 5 if i == 3 else None, "prompt": "1+2=", "sample": "3", "clipfrac": 0.1,
             "kl": 0.0, "off_policy": False} for i in range(n)]


def test_rl_demo_output_is_labelled_and_summarised(tmp_path):
    from ray_train_tpu.rl.cli import format_step, plot, summary

    history = _fake_history(8)
    lines = [format_step(m) for m in history]
    assert all(line.startswith("[SIMULATED] step") for line in lines)
    assert "reward 0.100 ± 0.050" in lines[1] and "parity OK" in lines[1]
    assert "retried" in lines[2] and "resumed from step 5" in lines[3]
    s = summary(history)
    assert s["reward_first5"] == pytest.approx(0.2) and s["reward_last5"] == pytest.approx(0.5)
    assert s["sync_fraction_of_step"] == pytest.approx(0.05 / 0.6)
    plot(history, tmp_path / "curve.png", "test")
    assert (tmp_path / "curve.png").stat().st_size > 1000
