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
