"""python -m ray_train_tpu plan: JSON for tools, a table for people, one-line errors."""

import io
import json
import subprocess
import sys

import pytest

from ray_train_tpu.cli import main
from ray_train_tpu.cli.plan import build_plan, worker_env
from ray_train_tpu.launch_env import ENV_KEYS
from ray_train_tpu.topology import Topology


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_plan_json_has_every_field_and_env():
    code, out, err = _run("plan", "--topology", "4x4", "--accelerator-type", "TPU-V6E", "--format", "json",
                          "--hosts", "a,b,c,d")
    assert code == 0 and err == ""
    plan = json.loads(out)
    for key in ("accelerator_type", "topology", "pod_type", "num_slices", "num_hosts", "chips_per_host",
                "num_workers", "resources_per_worker", "workers"):
        assert key in plan
    assert plan["num_workers"] == 16 and plan["resources_per_worker"] == {"TPU": 1}
    w = plan["workers"][6]
    assert set(w) == {"rank", "local_rank", "node_rank", "slice_id", "worker_id", "host", "chip_coords", "env"}
    assert (w["rank"], w["node_rank"], w["local_rank"], w["host"]) == (6, 1, 2, "b")
    assert set(worker_env(plan, 6)) == set(ENV_KEYS)
    assert all(isinstance(v, str) for v in worker_env(plan, 6).values())
    assert plan == json.loads(json.dumps(build_plan(Topology.parse("4x4", "TPU-V6E"), hosts=list("abcd"))))
    assert plan["hosts_are_placeholders"] is False and plan["env_expanded"] is False
    # Linear: the address list is given once per slice, not once per worker.
    assert out.count("a:8070,a:8071") == 1
    assert set(w["env"]) == {"RANK", "LOCAL_RANK", "NODE_RANK", "TPU_VISIBLE_CHIPS", "TPU_WORKER_ID"}


def test_plan_expand_env_gives_every_worker_its_whole_env():
    argv = ("plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4", "--format", "json", "--hosts", "a,b")
    _, linear, _ = _run(*argv)
    code, expanded, _ = _run(*argv, "--expand-env")
    assert code == 0
    linear, expanded = json.loads(linear), json.loads(expanded)
    assert expanded["env_expanded"] is True
    for rank in range(8):
        assert expanded["workers"][rank]["env"] == worker_env(linear, rank) == worker_env(expanded, rank)
        assert set(expanded["workers"][rank]["env"]) == set(ENV_KEYS)


def test_plan_json_size_grows_linearly_with_the_slice():
    sizes = {}
    for topo in ("4x4x4", "8x8x8"):  # 64 and 512 devices
        _, out, _ = _run("plan", "--topology", topo, "--accelerator-type", "TPU-V4", "--format", "json", "--compact")
        sizes[topo] = len(out)
    ratio = sizes["8x8x8"] / sizes["4x4x4"]
    assert 6 < ratio < 10, sizes  # 8x the workers; quadratic output would be ~64x


def test_placeholder_hosts_are_labelled():
    code, out, _ = _run("plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4", "--format", "json")
    assert json.loads(out)["hosts_are_placeholders"] is True
    _, table, _ = _run("plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4")
    assert "PLACEHOLDERS" in table
    _, table, _ = _run("plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4", "--hosts", "a,b")
    assert "PLACEHOLDERS" not in table


def test_plan_table_is_for_people():
    code, out, _ = _run("plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4")
    assert code == 0
    assert "v4-16" in out and "8 workers" in out
    assert "v4-16-s0-w1:8073" in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["plan", "--topology", "4x5", "--accelerator-type", "TPU-V6E"], "valid: 1x1, 2x2, 2x4, 4x4"),
        (["plan", "--topology", "4x4", "--accelerator-type", "TPU-V9"], "TPU-V4, TPU-V5P"),
        (["plan", "--topology", "4x4", "--accelerator-type", "TPU-V6E", "--hosts", "a,b"], "must list the 4 hosts"),
        (["plan", "--topology", "4x4", "--accelerator-type", "TPU-V6E", "--num-slices", "x"], "invalid int value"),
        (["plan"], "required"),
        (["nope"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, match):
    code, out, err = _run(*argv)
    assert code == 2 and out == ""
    assert err.startswith("ray_train_tpu: error: ") and err.count("\n") == 1
    assert match in err


def test_module_entry_point_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "ray_train_tpu", "plan", "--topology", "3x3", "--accelerator-type", "TPU-V6E"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "valid:" in proc.stderr


def test_plan_does_not_import_ray_or_torch():
    code = ("import sys; from ray_train_tpu.cli import main; main(['plan','--topology','2x2x2',"
            "'--accelerator-type','TPU-V4','--format','json']); "
            "assert 'ray' not in sys.modules and 'torch' not in sys.modules, 'heavy import'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_version_names_the_package_and_its_upstreams(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("ray_train_tpu ") and "ray 2.60.0" in line and "torch " in line


def test_help_is_plain_text_with_a_description_and_an_example_per_command():
    from ray_train_tpu.cli import _build_parser, command_modules

    parser = _build_parser()
    top = parser.format_help()
    assert "``" not in top and "Bad input is one line" in top
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(set(sub.choices))
    for name, p in sub.choices.items():
        text = p.format_help()
        assert p.description and "``" not in text, name
        if name != "serve":  # serve's parser is built by ray_train_tpu.serve.cli
            assert "example:\n  python -m ray_train_tpu " + name in text, name
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings} has no help text"


def test_a_missing_optional_package_is_one_line_naming_the_extra(monkeypatch):
    import ray_train_tpu.cli.plan as plan_cmd

    def needs_vllm(args, out):
        raise ModuleNotFoundError("No module named 'vllm'", name="vllm")

    monkeypatch.setattr(plan_cmd, "_plan", needs_vllm)
    code, out, err = _run("plan", "--topology", "2x2x2", "--accelerator-type", "TPU-V4")
    assert code == 2 and out == ""
    assert err == "ray_train_tpu: error: this command needs the optional package 'vllm': " \
                  "pip install 'ray-train-tpu[serve]'\n"
