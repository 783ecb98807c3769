"""The plan-scaling benchmark runs and records what it promises (not its timings)."""

import json

from benchmarks import plan_scaling


def test_plan_scaling_writes_json(tmp_path, monkeypatch):
    import benchmarks._common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    result = plan_scaling.main(["--repeats", "1", "--expanded-up-to", "64"])
    data = json.loads((tmp_path / "plan_scaling.json").read_text())
    assert data["rows"] == json.loads(json.dumps(result["rows"]))
    largest = max(data["rows"], key=lambda r: r["num_workers"])
    assert largest["num_workers"] == 6144  # v5p 16x16x24
    assert data["environment"]["simulated"] is False and data["environment"]["cpu_count"] >= 1
    assert all(r["plan_s"] > 0 for r in data["rows"])
    # The plan's JSON is linear in the slice: bytes per worker stay put from 4 to 6144 workers.
    assert 0.3 < data["json_bytes_per_worker_ratio_largest_to_smallest"] < 3
    assert largest["json_bytes"] < 5e6
