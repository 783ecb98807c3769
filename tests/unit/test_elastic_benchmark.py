"""benchmarks/elastic_recovery.py: its arguments, its parts of a recovery, its summary (no cluster)."""

import pytest

from benchmarks import elastic_recovery as bench


def test_defaults_and_bad_arguments(capsys):
    args = bench.parse_args([])
    assert (args.topology, args.accelerator_type, args.repeats, args.health_check) == ("1x1", "TPU-V6E", 2, "fast")
    for argv in (["--repeats", "0"], ["--param-mib", "0"], ["--health-check", "slow"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
    assert "error" in capsys.readouterr().err


class _Watch:
    created = {"old": 99.0, "failed": 103.0, "new": 110.0, "later": 200.0}

    placed_between = bench._PlacementWatch.placed_between


def test_a_recovery_is_split_into_its_parts_on_one_clock():
    states = [{"t": 101.0, "to": "RestartingState"}, {"t": 130.0, "to": "RestartingState"},
              {"t": 104.0, "to": "ReschedulingState"}]
    attempt = {"world": 2, "t_fn": 112.0, "t_built": 113.0, "t_restored": 115.5, "t_first_step": 116.0, "resumed_from": 10}
    event = bench._event("loss", 100.0, attempt, states, _Watch(), lost_from=13)
    assert event["detect_s"] == 1.0 and event["place_s"] == 9.0 and event["start_s"] == 2.0
    assert (event["build_s"], event["restore_s"], event["first_step_s"]) == (1.0, 2.5, 0.5)
    assert event["total_s"] == 16.0 and event["total_without_restore_s"] == 13.5
    assert event["failed_starts"] == 1 and event["steps_redone"] == 3
    assert sum(event[p] for p in bench.PARTS) == pytest.approx(event["total_s"])


def test_summary_takes_medians_per_kind_and_checks_the_goal():
    def row(kind, total, restore):
        return {"kind": kind, **{p: 1.0 for p in bench.PARTS}, "restore_s": restore,
                "total_s": total, "total_without_restore_s": total - restore}

    summary = bench.summarize([row("loss", 30, 5), row("loss", 90, 5), row("loss", 40, 5), row("return", 70, 2)])
    assert summary["loss"]["total_s"] == 40 and summary["loss"]["meets_goal"] is True
    assert summary["return"]["meets_goal"] is False
