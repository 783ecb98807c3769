"""benchmarks/serve_throughput.py parses its arguments and summarises what it
promises (no cluster: the summary is fed synthetic rows; the script itself
runs under `flock /tmp/simcluster.lock`, see its doc)."""

import pytest

from benchmarks import serve_throughput as st


def test_defaults_are_the_issue_levels():
    args = st.parse_args([])
    assert args.levels == [1, 8, 32] and args.model == "smollm2" and args.topology == "1x1"


@pytest.mark.parametrize("argv", [["--concurrency", "1,x"], ["--concurrency", "0"], ["--max-tokens", "0"],
                                  ["--requests-per-level", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        st.parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def _row(mode, c, tps):
    return {"mode": mode, "concurrency": c, "output_tokens_per_s": tps}


def test_summary_ratios_and_goals_at_the_highest_concurrency():
    rows = [_row("endpoint", 1, 10.0), _row("offline", 1, 20.0), _row("endpoint", 32, 90.0), _row("offline", 32, 100.0)]
    s = st.summarize(rows, generate_tps=15.0)
    assert s["at_concurrency"] == 32
    assert s["levels"][1]["endpoint_vs_offline"] == pytest.approx(0.5)
    assert s["levels"][32]["endpoint_vs_offline"] == pytest.approx(0.9)
    assert s["levels"][32]["endpoint_vs_generate"] == pytest.approx(6.0)
    assert s["meets_offline_goal"] and s["meets_generate_goal"]
    s = st.summarize([_row("endpoint", 32, 70.0), _row("offline", 32, 100.0)], generate_tps=20.0)
    assert not s["meets_offline_goal"] and not s["meets_generate_goal"]


def test_prompts_differ():
    texts = st.prompts(40)
    assert len(set(texts)) == 40


# --- benchmarks/batch_throughput.py -------------------------------------------------

from benchmarks import batch_throughput as bt  # noqa: E402


def test_batch_benchmark_defaults_and_bad_arguments(capsys):
    args = bt.parse_args([])
    assert (args.num_slices, args.topology, args.model, args.prompts) == (2, "1x1", "smollm2", 400)
    for argv in (["--num-slices", "0"], ["--max-tokens", "0"], ["--prompts", "7"]):
        with pytest.raises(SystemExit) as e:
            bt.parse_args(argv)
        assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_batch_rate_counts_only_while_every_engine_works():
    # slice a answers alone for 10 s (its engine started first), then both, 1 row/s each.
    arrivals = [(float(t), "a", 4) for t in range(10)] + [(10.0, "b", 4)]
    arrivals += [(10.0 + i / 2, "ab"[i % 2], 4) for i in range(1, 21)]
    rate = bt.steady_rate(arrivals, num_slices=2)
    assert rate["rows"] == 20 and rate["wall_s"] == pytest.approx(10.0)
    assert rate["rows_per_s"] == pytest.approx(2.0) and rate["tokens_per_s"] == pytest.approx(8.0)
    assert bt.steady_rate([(0.0, "a", 1), (1.0, "a", 1)], num_slices=2)["rows_per_s"] is None


def _run(rows_per_s, tokens_per_s):
    part = {"rows_per_s": rows_per_s, "tokens_per_s": tokens_per_s}
    return {"job": part, "steady": dict(part)}


def test_batch_summary_judges_the_geometric_mean_pair_ratio_of_the_whole_job_with_its_interval():
    import math

    pairs = [(_run(9.5, 300.0), _run(10.0, 320.0)), (_run(8.0, 280.0), _run(10.0, 300.0)),
             (_run(12.0, 330.0), _run(10.0, 300.0))]
    s = bt.summarize(pairs)
    assert s["job_batch_vs_offline_rows_per_s"] == pytest.approx(0.95)  # median of 0.8, 0.95, 1.2
    assert s["job_rows_per_s_ratios"] == pytest.approx([0.8, 0.95, 1.2])
    geo = (0.8 * 0.95 * 1.2) ** (1 / 3)
    assert s["job_rows_per_s_geomean"] == pytest.approx(geo) and s["meets_goal"]
    logs = [math.log(r) for r in (0.8, 0.95, 1.2)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    low, high = s["job_rows_per_s_ci95"]
    assert low == pytest.approx(math.exp(mean - 4.303 * sd / math.sqrt(3)))  # t(0.975, 2 df) = 4.303
    assert high == pytest.approx(math.exp(mean + 4.303 * sd / math.sqrt(3)))
    assert not s["meets_goal_at_95"]  # the interval reaches below 0.9
    s = bt.summarize(pairs[:2])  # even count: the median is the mean of the middle two
    assert s["job_batch_vs_offline_rows_per_s"] == pytest.approx(0.875) and not s["meets_goal"]
    assert bt.summarize(pairs[:1])["job_rows_per_s_ci95"] is None  # one pair: no interval
