"""docs/results.md against benchmarks/results/*.json: every number listed here is
formatted from its JSON as the page writes it and must appear on the page, so a
benchmark rerun that changes a result fails this test until the page says the same."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _get(name: str, path: str):
    value = json.loads((RESULTS / f"{name}.json").read_text())
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


def _ratio_ci(name: str) -> str:
    """A benchmark's whole-job ratio and its 95% interval, as the page writes them."""
    lo, hi = _get(name, "summary.job_rows_per_s_ci95")
    return "{:.2f} x [{:.2f}, {:.2f}]".format(_get(name, "summary.job_rows_per_s_geomean"), lo, hi)


# (what the page says, built from the JSON) - one entry per number the page quotes.
CLAIMS = {
    "batch: whole job vs offline, 400 / 40 prompts": lambda: "{} / {}".format(
        _ratio_ci("batch_throughput"), _ratio_ci("batch_throughput_40")),
    "rl: reward first 5 -> last 5": lambda: "{:.3f} -> {:.3f}".format(
        _get("rl_demo", "summary.reward_first5"), _get("rl_demo", "summary.reward_last5")),
    "rl: steps": lambda: "last 5 of {} steps".format(_get("rl_demo", "summary.steps")),
    "rl: exact at the last step": lambda: "(step {}: {} exactly right)".format(
        _get("rl_demo", "history.-1.step"), _pct(_get("rl_demo", "history.-1.exact"))),
    "rl: median step and phases": lambda: "{:.2f} s ({:.2f} / {:.2f} / {:.2f} / {:.2f} / {:.2f})".format(
        *(_get("rl_demo", f"summary.median_s.{k}") for k in ("step_s", "rollout_s", "reward_s", "train_s", "sync_s",
                                                              "parity_s"))),
    "rl: demo sync share": lambda: "{:.2f} s median = {} of a step".format(
        _get("rl_demo", "summary.median_s.sync_s"), _pct(_get("rl_demo", "summary.sync_fraction_of_step"))),
    "rl: demo sync share (summary)": lambda: "{} ({:.2f} s of {:.2f} s)".format(
        _pct(_get("rl_demo", "summary.sync_fraction_of_step")), _get("rl_demo", "summary.median_s.sync_s"),
        _get("rl_demo", "summary.median_s.step_s")),
    "rl: 100 M sync share": lambda: "{:.2f} s = {} of a {:.2f} s step".format(
        _get("rl_phases", "overlap_100m.median_s.sync_s"), _pct(_get("rl_phases", "overlap_100m.sync_fraction_of_step"),
                                                                1),
        _get("rl_phases", "overlap_100m.median_s.step_s")),
    "rl: 100 M sync share (summary)": lambda: "{} ({:.2f} s of {:.2f} s)".format(
        _pct(_get("rl_phases", "overlap_100m.sync_fraction_of_step"), 1),
        _get("rl_phases", "overlap_100m.median_s.sync_s"), _get("rl_phases", "overlap_100m.median_s.step_s")),
    "fsdp2 state vs ddp / world": lambda: "| {:.2f} x | <= 1.1 x: met |".format(
        _get("strategy_memory", "fsdp2_target.measured")),
    "chip memory per strategy": lambda: "chip peak per rank {} MiB (DDP / FSDP2 / TP / FSDP2+TP)".format(
        " / ".join(f"{r['max_device_peak_bytes'] / 2**20:.1f}" for r in _get("strategy_memory", "rows"))),
    "log-probs: chunked vs naive": lambda: "{:.0f} MiB against {:.0f} MiB ({})".format(
        _get("logprob_memory", "at_tokens.chunked_mib"), _get("logprob_memory", "at_tokens.naive_mib_extrapolated"),
        _pct(_get("logprob_memory", "at_tokens.ratio"), 1)),
    "log-probs: measured pair": lambda: "{:.0f} MiB against {:.0f} MiB".format(
        _get("logprob_memory", "measured_pair.chunked"), _get("logprob_memory", "measured_pair.naive")),
}


def _logprob_row(tokens: int) -> str:
    rows = {r["path"]: r["peak_growth_mib"] for r in _get("logprob_memory", "measurements") if r["tokens"] == tokens}
    return "| {} | {:,.0f} MiB | {:,.0f} MiB |".format(tokens, rows["naive"], rows["chunked"])


for _tokens in (64, 128, 256):
    CLAIMS[f"log-probs: table row {_tokens}"] = lambda t=_tokens: _logprob_row(t)


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_results_page_says_what_the_json_says(claim):
    page = (ROOT / "docs" / "results.md").read_text()
    text = CLAIMS[claim]()
    assert text in page, f"docs/results.md should say {text!r} ({claim}): rerun numbers differ from the page"


def test_a_changed_result_would_fail():
    """The check can fail: a value moved by one in its last printed digit is not on the page."""
    page = (ROOT / "docs" / "results.md").read_text()
    first, last = _get("rl_demo", "summary.reward_first5"), _get("rl_demo", "summary.reward_last5")
    assert "{:.3f} -> {:.3f}".format(first, last) in page
    assert "{:.3f} -> {:.3f}".format(first, last + 0.001) not in page
