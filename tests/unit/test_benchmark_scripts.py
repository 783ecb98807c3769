"""The issue-7 benchmarks parse their arguments, summarise and write what they promise.

No Ray cluster: summaries are fed synthetic runs, and the one end-to-end run is
step_overhead's torchrun launcher on a one-process "slice" (TPU-V6E 1x1).
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks import run_all, startup, step_overhead, strategy_memory


def test_run_all_runs_the_new_scripts():
    assert {"step_overhead.py", "startup.py", "strategy_memory.py"} <= set(run_all.SCRIPTS)
    for script in run_all.SCRIPTS:
        assert (run_all.HERE / script).is_file()


# --- step_overhead ---------------------------------------------------------------

def test_step_overhead_defaults_are_the_small_simulated_slice():
    args = step_overhead.parse_args([])
    assert args.device == "cpu" and args.launchers == list(step_overhead.DEFAULT_LAUNCHERS)
    assert step_overhead._num_workers(args) == 4  # v4 2x2x1
    assert args.ray_worker_niceness == 0


@pytest.mark.parametrize("argv", [["--launchers", "ours,mpirun"], ["--launchers", ","], ["--steps", "0"],
                                  ["--device", "rocm"], ["--peak-tflops", "-1"], ["--warmup-steps", "-1"],
                                  ["--preemption-checks", "none,bogus"], ["--preemption-checks", "guard,guard"],
                                  ["--preemption-checks", "none,guard"]])  # the default launchers include TorchTrainer
def test_step_overhead_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        step_overhead.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_step_overhead_pairs_each_preemption_check_with_none_by_repeat():
    args = step_overhead.parse_args(["--launchers", "torchrun", "--preemption-checks", "none,guard"])
    assert args.preemption_checks == ["none", "guard"]
    runs = [{"launcher": "torchrun", "preemption_check": check, "repeat": r, "steps_per_s": rate,
             "cpu_ms_per_step": 10.0} for r, (a, b) in enumerate([(10.0, 9.0), (20.0, 19.0)])
            for check, rate in (("none", a), ("guard", b))]
    got = step_overhead.summarize_preemption_checks(runs, ["none", "guard"])["torchrun"]
    assert got["none"]["median_steps_per_s"] == 15.0 and got["none"]["paired_over_none"] is None
    paired = got["guard"]["paired_over_none"]["steps_per_s"]
    assert paired["pairs"] == 2 and paired["per_repeat"] == pytest.approx([0.9, 0.95])


def test_step_overhead_on_tpu_runs_ours_alone(capsys):
    assert step_overhead.parse_args(["--device", "tpu"]).launchers == ["ours"]
    assert capsys.readouterr().err == ""
    assert step_overhead.parse_args(["--device", "tpu", "--launchers", "ours,torchrun"]).launchers == ["ours"]
    assert "ignoring --launchers 'ours,torchrun'" in capsys.readouterr().err


def test_launch_order_rotates():
    order = [step_overhead.rotated(["a", "b", "c"], r) for r in range(4)]
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def _run(launcher, rate, repeat):
    return {"launcher": launcher, "steps_per_s": rate, "repeat": repeat, "tokens_per_s": rate * 100, "mfu": None,
            "cpu_ms_per_step": 100.0 / rate}


def test_step_overhead_summary_takes_medians_and_checks_targets():
    runs = [_run("ours", 9.9, 0), _run("torch_trainer", 10.0, 0), _run("torchrun", 10.6, 0),
            _run("ours", 10.0, 1), _run("torch_trainer", 9.0, 1), _run("torchrun", 10.5, 1),
            _run("ours", 50.0, 2), _run("torch_trainer", 9.5, 2), _run("torchrun", 10.0, 2)]
    s = step_overhead.summarize(runs)
    assert s["launchers"]["ours"]["median_steps_per_s"] == 10.0  # the outlier does not move a median
    assert s["ratios"]["ours_over_torchrun"] == pytest.approx(10.0 / 10.5)
    assert s["ratios"]["ours_over_torch_trainer"] == pytest.approx(10.0 / 9.5)
    assert s["targets"]["ours_over_torchrun"]["met"] is False  # 0.952 < 0.98
    assert s["targets"]["ours_over_torch_trainer"]["met"] is True
    assert s["cpu_per_step_ratios"]["ours_over_torchrun"] == pytest.approx(10.5 / 10.0)  # lower is better


def test_step_overhead_summary_without_ours_has_no_ratios():
    s = step_overhead.summarize([_run("torchrun", 3.0, 0)])
    assert s["ratios"] == {} and s["targets"] == {}


def test_step_overhead_torchrun_writes_its_json(tmp_path, monkeypatch):
    import benchmarks._common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    step_overhead.main(["--launchers", "torchrun", "--topology", "1x1", "--accelerator-type", "TPU-V6E",
                        "--repeats", "1", "--warmup-steps", "1", "--warmup-s", "0.3", "--steps", "2", "--dim", "8",
                        "--hidden", "16", "--layers", "1", "--batch-size", "2", "--seq-len", "4"])
    data = json.loads((tmp_path / "step_overhead.json").read_text())
    (run,) = data["runs"]
    assert run["launcher"] == "torchrun" and run["world_size"] == 1 and run["torch_threads"] == 1
    assert run["steps_per_s"] > 0 and run["cpu_ms_per_step"] > 0 and run["params"] == 8 * 16 + 16 + 16 * 8 + 8
    assert data["environment"]["simulated"] is False  # torchrun alone simulates no slice
    assert {"versions", "commit", "cpu_count"} <= set(data["environment"])
    assert data["settings"]["num_workers"] == 1 and data["ratios"] == {}
    assert (run["warmup_steps_run"] - 1) % 10 == 0  # 1, then chunks of 10 until 0.3 s have passed
    assert isinstance(run["thread_cpu_ms_per_step"], dict) and run["cpu_affinity"]  # 2 steps: often under a tick
    assert (tmp_path / "step_overhead.png").exists()


# --- startup -----------------------------------------------------------------------

def test_startup_sizes():
    assert startup.parse_args([]).sizes == [4, 8]
    assert startup.parse_args(["--with-16"]).sizes == [4, 8, 16]
    with pytest.raises(SystemExit):
        startup.parse_args(["--sizes", "4,32"])
    with pytest.raises(SystemExit):
        startup.parse_args(["--sizes", "four"])


def _fit(trainer, size, total, on_start):
    phases = dict(fit_to_on_start_s=total - on_start - 1.5, on_start_s=on_start, on_start_to_loop_s=0.5,
                  loop_to_first_step_s=1.0)
    return {"trainer": trainer, "num_workers": size, "fit_to_first_step_s": total, "fit_to_worker_process_s": 3.0,
            "fit_s": total + 2, **phases}


def test_startup_summary_ratio_and_target():
    runs = [_fit("ours", 4, 22.0, 0.3), _fit("torch_trainer", 4, 20.0, 0.2),
            _fit("torch_trainer", 4, 20.0, 0.2), _fit("ours", 4, 22.0, 0.5),
            _fit("ours", 8, 30.0, 0.4), _fit("torch_trainer", 8, 25.0, 0.2)]
    rows = {r["num_workers"]: r for r in startup.summarize(runs)}
    assert rows[4]["ratio_fit_to_first_step"] == pytest.approx(1.1) and rows[4]["met"] is True
    assert rows[4]["ours_on_start_s"] == pytest.approx(0.4)  # median of 0.3 and 0.5
    assert rows[8]["ratio_fit_to_first_step"] == pytest.approx(1.2) and rows[8]["met"] is False


def test_startup_timed_configs_keep_their_backends():
    ours = startup.TimedTPUTorchConfig(timing_file="/x")
    theirs = startup.TimedTorchConfig(backend="gloo", timing_file="/y")
    assert issubclass(ours.backend_cls, startup._TPUTorchBackend) and ours.timing_file == "/x"
    assert issubclass(theirs.backend_cls, startup._TorchBackend) and theirs.backend == "gloo"


# --- strategy_memory -------------------------------------------------------------

def test_strategy_memory_arguments():
    args = strategy_memory.parse_args([])
    n = sum(p.numel() for p in strategy_memory.mlp(args.dim, args.hidden, args.blocks).parameters())
    assert 10e6 <= n <= 20e6  # "big enough to matter"
    assert args.strategies == list(strategy_memory.STRATEGIES)
    for argv in (["--dim", "30"], ["--strategies", "zero3"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            strategy_memory.parse_args(argv)


def test_tp_plan_names_the_linear_layers():
    model = strategy_memory.mlp(8, 16, 3)
    names = dict(model.named_modules())
    plan = strategy_memory.tp_plan(3)
    assert len(plan) == 6 and all(isinstance(names[k], torch.nn.Linear) for k in plan)


def test_state_bytes_of_plain_adamw():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    got = strategy_memory.state_bytes(model, opt)
    assert got["param_bytes"] == got["grad_bytes"] == 15 * 4
    # exp_avg and exp_avg_sq per parameter, plus a scalar step tensor per parameter
    assert got["optimizer_bytes"] == 2 * 15 * 4 + 2 * opt.state[model.weight]["step"].element_size()


def test_local_bytes_counts_a_dtensor_shard():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.zeros(8, 16)
        assert strategy_memory.local_bytes(distribute_tensor(full, mesh, [Shard(0)])) == 2 * 16 * 4
        assert strategy_memory.local_bytes(distribute_tensor(full, mesh, [Replicate()])) == 8 * 16 * 4
        assert strategy_memory.local_bytes(full) == 8 * 16 * 4
    finally:
        dist.destroy_process_group()


def test_strategy_memory_summary_ratio():
    rows = [{"strategy": "ddp", "max_state_bytes": 400}, {"strategy": "fsdp2", "max_state_bytes": 104},
            {"strategy": "tp", "max_state_bytes": 120}]
    s = strategy_memory.summarize(rows, num_params=25)
    assert s["full_state_bytes"] == 25 * 16 and s["ddp_over_world_bytes"] == 100
    assert s["fsdp2_target"]["measured"] == pytest.approx(1.04) and s["fsdp2_target"]["met"] is True
    assert rows[2]["state_over_ddp_per_world"] == pytest.approx(1.2)


# --- step_overhead --callgrind ------------------------------------------------------

def test_callgrind_mode_defaults_to_few_steps_but_keeps_given_values():
    args = step_overhead.parse_args(["--callgrind"])
    assert (args.steps, args.warmup_steps, args.repeats, args.warmup_s) == (20, 5, 1, 0.0)
    args = step_overhead.parse_args(["--callgrind", "--steps", "7", "--repeats=2"])
    assert (args.steps, args.warmup_steps, args.repeats) == (7, 5, 2)
    assert step_overhead.parse_args([]).steps == 300  # timing mode unchanged


def test_callgrind_mode_is_cpu_only(capsys):
    with pytest.raises(SystemExit):
        step_overhead.parse_args(["--callgrind", "--device", "cuda"])
    assert "--callgrind runs on --device cpu only" in capsys.readouterr().err


_DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd:  python default_worker.py {long_args}
part: 1

desc: I1 cache: 
desc: Timerange: Basic block 0 - 99
desc: Trigger: Client Request: rtt_steps:{label}

positions: line
events: Ir
summary: {n}

fn=(1) main
0 {n}

totals: {n}
"""


def test_callgrind_dump_is_found_by_label_and_read(tmp_path):
    from benchmarks import _callgrind

    (tmp_path / "callgrind.out.4242").write_text(_DUMP.format(label="x", n=5, long_args="").replace(
        "Client Request: rtt_steps:x", "Program termination"))  # the exit dump: not ours
    (tmp_path / "callgrind.out.4242.1").write_text(_DUMP.format(label="ours", n=123456, long_args="--arg " * 3000))
    dump = _callgrind.find_dump(str(tmp_path), "ours")
    assert dump.name == "callgrind.out.4242.1"
    assert _callgrind.read_counts(dump) == {"pid": "4242", "thread": None, "instructions": 123456}
    (tmp_path / "callgrind.out.4243-02").write_text(
        _DUMP.format(label="one", n=7, long_args="").replace("part: 1", "part: 1\nthread: 2"))
    assert _callgrind.read_counts(_callgrind.find_dump(str(tmp_path), "one"))["thread"] == 2
    with pytest.raises(RuntimeError, match="no callgrind dump named 'rtt_steps:torchrun'"):
        _callgrind.find_dump(str(tmp_path), "torchrun")


_LIBRARY_DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 77
cmd:  python worker.py
part: 1

desc: Trigger: Client Request: rtt_steps:ours

positions: line
events: Ir
summary: 1500

ob=(1) /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
fl=(1) ???
fn=(1) sgemm_kernel
0 900
ob=(2) /venv/lib/python3.11/site-packages/ray/_raylet.so
fl=(1)
fn=(2) grpc_poll
0 300
ob=(3) /usr/lib/x86_64-linux-gnu/libc.so.6
fl=(1)
fn=(3) malloc
0 200
ob=(1)
fl=(1)
fn=(4) gloo_sum
0 100

totals: 1500
"""


@pytest.mark.skipif(shutil.which("callgrind_annotate") is None, reason="callgrind_annotate (valgrind) not installed")
def test_callgrind_result_says_which_library_the_instructions_went_to(tmp_path):
    from benchmarks import _callgrind

    (tmp_path / "callgrind.out.77").write_text(_LIBRARY_DUMP)
    dump = _callgrind.find_dump(str(tmp_path), "ours")
    assert _callgrind.by_library(dump) == {"libtorch_cpu.so": 1000, "_raylet.so": 300, "libc.so.6": 200}
    result = step_overhead.callgrind_result(dump, steps=10)
    assert result["instructions_per_step"] == 150.0
    assert result["by_library_per_step"]["_raylet.so"] == 30.0
    assert [r["object"] for r in result["top_functions_self"]][:2] == ["libtorch_cpu.so", "_raylet.so"]


def test_callgrind_thread_scope_sets_valgrinds_thread_option(tmp_path):
    from benchmarks import _callgrind

    assert "--separate-threads=no" in _callgrind.valgrind_command("/o")
    assert "--separate-threads=yes" in _callgrind.valgrind_command("/o", "training")
    with pytest.raises(ValueError, match="threads='some'"):
        _callgrind.valgrind_command("/o", "some")
    args = step_overhead.parse_args(["--callgrind", "--callgrind-threads", "training"])
    assert args.callgrind_threads == "training"


def _fake_valgrind(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "valgrind"
    fake.write_text('#!/bin/sh\necho "valgrind RTT_CALLGRIND=$RTT_CALLGRIND"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_callgrind_wrapper_counts_one_process(tmp_path, monkeypatch):
    import subprocess

    from benchmarks import _callgrind

    _fake_valgrind(tmp_path, monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    first_come = _callgrind.write_wrapper(tmp_path / "ray.sh", "/bin/echo", str(out), rank_env=None)
    runs = [subprocess.run([str(first_come), "worker"], capture_output=True, text=True).stdout for _ in range(3)]
    assert runs == ["valgrind RTT_CALLGRIND=1\n", "worker\n", "worker\n"]  # the first to start, only
    by_rank = _callgrind.write_wrapper(tmp_path / "torchrun.sh", "/bin/echo", str(out), rank_env="RANK")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    got = {r: subprocess.run([str(by_rank), "w"], capture_output=True, text=True, env={**env, "RANK": r}).stdout
           for r in ("0", "1")}
    assert got == {"0": "valgrind RTT_CALLGRIND=1\n", "1": "w\n"}


def test_marker_refuses_to_run_outside_valgrind(monkeypatch):
    from benchmarks import _callgrind

    if _callgrind.available():
        pytest.skip(_callgrind.available())
    assert _callgrind.Marker.from_env({}) is None
    with pytest.raises(RuntimeError, match="not running under valgrind"):
        _callgrind.Marker.from_env({_callgrind.ENV_FLAG: "1"})


def test_callgrind_summary_ratios():
    runs = [{"launcher": "ours", "callgrind": {"instructions_per_step": 110.0}},
            {"launcher": "torchrun", "callgrind": {"instructions_per_step": 100.0}},
            {"launcher": "torch_trainer", "callgrind": {"instructions_per_step": 120.0}},
            {"launcher": "ours", "callgrind": {"instructions_per_step": 130.0}},
            {"launcher": "ours", "callgrind": {"instructions_per_step": 90.0}}]
    s = step_overhead.summarize_callgrind(runs)
    assert s["launchers"]["ours"]["instructions_per_step"] == 110.0
    assert s["ratios"] == {"ours_over_torchrun": pytest.approx(1.1), "ours_over_torch_trainer": pytest.approx(110 / 120)}
    assert s["threads"] == "all" and "every thread" in s["note"]
    assert "training steps alone" in step_overhead.summarize_callgrind(runs, "training")["note"]


def test_ddp_bucket_choices_map_to_ours_strategy():
    assert step_overhead.ours_strategy("default").fixed_bucket_order is True
    assert step_overhead.ours_strategy("rebuild").fixed_bucket_order is False
    s = step_overhead.ours_strategy("find_unused")
    assert s.find_unused_parameters is True and s.fixed_bucket_order is False


def test_every_benchmark_records_the_cpu():
    from benchmarks._common import environment

    cpu = environment(simulated=False)["cpu"]
    assert cpu["model"] and cpu["flags"] and set(cpu["isa"]) <= set(cpu["flags"].split())


def test_paired_ratio_interval():
    runs = [_run("ours", 10.0, 0), _run("torchrun", 10.0, 0), _run("ours", 11.0, 1), _run("torchrun", 10.0, 1),
            _run("ours", 9.0, 2), _run("torchrun", 10.0, 2)]
    ci = step_overhead.paired_ratio_ci(runs, "ours", "torchrun", "steps_per_s")
    assert ci["pairs"] == 3 and ci["ci95"][0] < 1.0 < ci["ci95"][1]
    assert ci["ratio"] == pytest.approx((1.0 * 1.1 * 0.9) ** (1 / 3))
    tight = [_run("ours", 10.5 + 0.01 * i, i) for i in range(5)] + [_run("torchrun", 10.0, i) for i in range(5)]
    ci = step_overhead.paired_ratio_ci(tight, "ours", "torchrun", "steps_per_s")
    assert 1.0 < ci["ci95"][0] < ci["ratio"] < ci["ci95"][1] < 1.06
    assert step_overhead.paired_ratio_ci(runs[:2], "ours", "torchrun", "steps_per_s") is None
    s = step_overhead.summarize(runs)
    assert s["paired_ratios"]["ours_over_torchrun"]["cpu_ms_per_step"]["pairs"] == 3


def test_marker_reads_the_environment_of_the_process_it_runs_in(monkeypatch):
    """Ray workers get this module pickled by value: the flag must be read from the
    worker's own environment, not from a copy of the driver's taken at pickling."""
    import ray.cloudpickle

    from benchmarks import _callgrind

    ray.cloudpickle.register_pickle_by_value(_callgrind)
    try:
        shipped = ray.cloudpickle.loads(ray.cloudpickle.dumps(_callgrind.Marker.from_env))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(_callgrind)
    monkeypatch.setenv(_callgrind.ENV_FLAG, "1")  # set after pickling, as in the worker
    with pytest.raises(RuntimeError, match="not running under valgrind"):
        shipped()


def test_busiest_other_processes_leave_out_the_ranks():
    before = {1: (1.0, "raylet"), 2: (5.0, "ray::RayTrainWorker"), 3: (0.5, "gcs_server")}
    after = {1: (1.5, "raylet"), 2: (9.0, "ray::RayTrainWorker"), 3: (0.5, "gcs_server"), 4: (0.2, "new")}
    rows = step_overhead.busiest_processes(before, after, steps=100, exclude={2})
    assert [(r["command"], round(r["ms_per_step"], 3)) for r in rows] == [("raylet", 5.0), ("new", 2.0)]
    mine = step_overhead.processes_cpu_s()
    assert os.getpid() in mine and mine[os.getpid()][0] > 0


def test_thread_cpu_is_summed_by_thread_name():
    before = {1: ("python", 1.0, 0.5), 2: ("grpc_global_tim", 0.1, 0.0), 3: ("gloo", 0.0, 0.0)}
    after = {1: ("python", 2.0, 0.7), 2: ("grpc_global_tim", 0.1, 0.0), 3: ("gloo", 0.05, 0.15),
             4: ("python", 0.2, 0.0)}
    rows = step_overhead.per_thread_ms(before, after, steps=10)
    assert list(rows) == ["python", "gloo"]
    assert rows["python"] == {"user": pytest.approx(120.0), "system": pytest.approx(20.0)}
    assert rows["gloo"] == {"user": pytest.approx(5.0), "system": pytest.approx(15.0)}
    assert os.getpid() in step_overhead.threads_cpu_s()  # the main thread's id is the pid


def test_cpu_targets_are_judged_on_the_interval():
    assert step_overhead.cpu_verdict({"ratio": 1.0, "ci95": [0.98, 1.01]}, 1.02)["verdict"] == "met"
    assert step_overhead.cpu_verdict({"ratio": 1.07, "ci95": [1.05, 1.10]}, 1.02)["verdict"] == "missed"
    assert step_overhead.cpu_verdict({"ratio": 1.02, "ci95": [0.99, 1.05]}, 1.0)["verdict"] == "undecided"
    runs = [dict(_run("ours", 10.0, i), cpu_ms_per_step=c) for i, c in enumerate((10.0, 10.2, 9.9))]
    runs += [dict(_run("torchrun", 10.0, i), cpu_ms_per_step=c) for i, c in enumerate((9.0, 9.1, 9.0))]
    s = step_overhead.summarize(runs)
    assert s["cpu_targets"]["ours_over_torchrun"]["verdict"] == "missed"
    assert "ours_over_torch_trainer" not in s["cpu_targets"]


# --- step_overhead torchrun_beside_ray ------------------------------------------------

def test_torchrun_beside_ray_is_asked_for_by_name_and_cpu_only(capsys):
    assert "torchrun_beside_ray" not in step_overhead.parse_args([]).launchers
    args = step_overhead.parse_args(["--launchers", "torchrun,torchrun_beside_ray"])
    assert args.launchers == ["torchrun", "torchrun_beside_ray"]
    for argv in (["--device", "cuda", "--launchers", "torchrun_beside_ray"],
                 ["--callgrind", "--launchers", "ours,torchrun_beside_ray"]):
        with pytest.raises(SystemExit):
            step_overhead.parse_args(argv)
        assert "torchrun_beside_ray" in capsys.readouterr().err


class _FakeTrainer:
    """Runs the loop on `ranks` threads, as Ray Train runs it on its workers."""

    def __init__(self, loop, cfg, ranks=2, fail=None):
        self.loop, self.cfg, self.ranks, self.fail = loop, cfg, ranks, fail

    def fit(self):
        import threading
        import types
        from unittest import mock

        if self.fail:
            raise self.fail
        errors, local = [], threading.local()
        ctx = types.SimpleNamespace(get_world_rank=lambda: local.rank)

        def rank(r):
            local.rank = r
            try:
                self.loop(self.cfg)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.ranks)]
        with mock.patch("ray.train.get_context", return_value=ctx):
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return types.SimpleNamespace(error=errors[0] if errors else None)


def test_idle_ray_train_run_is_up_during_the_block_and_stopped_after():
    import threading

    seen = {}
    with step_overhead.ray_train_running_idle(lambda loop, cfg: seen.setdefault("t", _FakeTrainer(loop, cfg)),
                                              timeout_s=30):
        cfg = seen["t"].cfg
        assert Path(cfg["ready"]).read_text() == "up" and not Path(cfg["stop"]).exists()
        assert any(t.name == "idle-ray-train-run" for t in threading.enumerate())
    assert not any(t.name == "idle-ray-train-run" for t in threading.enumerate())
    assert not Path(cfg["ready"]).parent.exists()  # its temporary files are gone


def test_idle_ray_train_run_that_fails_to_start_raises_in_the_driver():
    with pytest.raises(RuntimeError, match="ended before its workers were up.*no CPUs left"):
        with step_overhead.ray_train_running_idle(
                lambda loop, cfg: _FakeTrainer(loop, cfg, fail=ValueError("no CPUs left")), timeout_s=30):
            pytest.fail("the block must not run")


def test_summary_pairs_torchrun_beside_ray_with_the_others():
    runs = [_run(name, rate, r) for r in range(3)
            for name, rate in (("ours", 9.5 + 0.1 * r, ), ("torch_trainer", 9.6, ), ("torchrun", 10.0, ),
                               ("torchrun_beside_ray", 9.7 - 0.05 * r, ))]
    s = step_overhead.summarize(runs)
    for key in ("torchrun_beside_ray_over_torchrun", "ours_over_torchrun_beside_ray",
                "torch_trainer_over_torchrun_beside_ray"):
        assert s["paired_ratios"][key]["cpu_ms_per_step"]["pairs"] == 3
    assert s["paired_ratios"]["torchrun_beside_ray_over_torchrun"]["steps_per_s"]["ratio"] < 1.0
    assert set(s["cpu_targets"]) == {"ours_over_torchrun", "ours_over_torch_trainer"}


# --- step_overhead torchrun_in_thread -------------------------------------------------

def test_torchrun_in_thread_is_asked_for_by_name_and_not_under_callgrind(capsys):
    assert "torchrun_in_thread" not in step_overhead.parse_args([]).launchers
    args = step_overhead.parse_args(["--launchers", "torchrun_in_thread,torchrun"])
    assert args.launchers == ["torchrun_in_thread", "torchrun"]
    with pytest.raises(SystemExit):
        step_overhead.parse_args(["--callgrind", "--launchers", "torchrun,torchrun_in_thread"])
    assert "torchrun_in_thread" in capsys.readouterr().err


def test_in_thread_runs_the_loop_off_the_main_thread_and_returns_or_raises():
    import threading

    def loop(x):
        return x, threading.current_thread().name, threading.current_thread() is threading.main_thread()

    assert step_overhead.in_thread(loop, 3) == (3, "TrainingThread", False)

    def broken():
        raise ValueError("step 7 diverged")

    with pytest.raises(ValueError, match="step 7 diverged"):
        step_overhead.in_thread(broken)


def test_summary_pairs_torchrun_in_thread_with_the_others():
    runs = [_run(name, rate, r) for r in range(3)
            for name, rate in (("ours", 9.5 + 0.1 * r, ), ("torchrun", 10.0, ),
                               ("torchrun_in_thread", 9.6 - 0.05 * r, ))]
    s = step_overhead.summarize(runs)
    for key in ("torchrun_in_thread_over_torchrun", "ours_over_torchrun_in_thread"):
        assert s["paired_ratios"][key]["steps_per_s"]["pairs"] == 3
    assert "torch_trainer_over_torchrun_in_thread" not in s["paired_ratios"]
    assert s["paired_ratios"]["torchrun_in_thread_over_torchrun"]["steps_per_s"]["ratio"] < 1.0


# --- step_overhead --pool --------------------------------------------------------------

def _result(rates: dict, repeats: int, model="Intel(R) Xeon(R) Processor", steps=600):
    runs = [_run(name, rate(r), r) for r in range(repeats) for name, rate in rates.items()]
    return {"question": "q", "environment": {"cpu": {"model": model}, "commit": "abc", "simulated": True},
            "device": "cpu", "tested_here": True, "note": "n.", "runs": runs,
            "settings": {"device": "cpu", "steps": steps, "num_workers": 4, "repeats": repeats,
                         "launchers": list(rates)}}


def test_pool_pairs_repeats_within_their_own_run_only():
    # Run 1 is fast for every launcher, run 2 slow: pairing across runs would be
    # dominated by that; within a run, ours/torchrun is 0.9 every time.
    a = _result({"ours": lambda r: 18.0, "torchrun": lambda r: 20.0}, 3)
    b = _result({"ours": lambda r: 9.0, "torchrun": lambda r: 10.0, "torch_trainer": lambda r: 9.5}, 2)
    pooled = step_overhead.pool_results([a, b], ["a.json", "b.json"])
    ci = pooled["paired_ratios"]["ours_over_torchrun"]["steps_per_s"]
    assert ci["pairs"] == 5 and ci["ratio"] == pytest.approx(0.9)
    assert pooled["paired_ratios"]["ours_over_torch_trainer"]["steps_per_s"]["pairs"] == 2
    assert pooled["settings"]["repeats"] == 5
    assert pooled["settings"]["launchers"] == ["ours", "torchrun", "torch_trainer"]
    assert [p["file"] for p in pooled["pooled_from"]] == ["a.json", "b.json"]


def test_pool_refuses_other_settings_or_another_cpu():
    a = _result({"ours": lambda r: 9.0, "torchrun": lambda r: 10.0}, 2)
    with pytest.raises(ValueError, match=r"b.json was run with other settings.*steps: 600 vs 300"):
        step_overhead.pool_results([a, _result({"ours": lambda r: 9.0, "torchrun": lambda r: 10.0}, 2, steps=300)],
                                   ["a.json", "b.json"])
    with pytest.raises(ValueError, match="one CPU model"):
        step_overhead.pool_results([a, _result({"ours": lambda r: 9.0, "torchrun": lambda r: 10.0}, 2,
                                               model="AMD EPYC")], ["a.json", "b.json"])


def test_pool_needs_two_existing_files(tmp_path, capsys):
    one = tmp_path / "one.json"
    one.write_text("{}")
    for argv, says in ((["--pool", str(one)], "two or more"),
                       (["--pool", f"{one},{tmp_path / 'gone.json'}"], "no such file")):
        with pytest.raises(SystemExit):
            step_overhead.parse_args(argv)
        assert says in capsys.readouterr().err


def test_pool_keeps_only_paired_ratios_and_still_judges_the_cpu_targets():
    a = _result({"ours": lambda r: 18.0 + 0.1 * r, "torchrun": lambda r: 20.0}, 3)
    b = _result({"ours": lambda r: 9.0 + 0.1 * r, "torchrun": lambda r: 10.0}, 3)
    pooled = step_overhead.pool_results([a, b], ["a.json", "b.json"])
    assert pooled["targets"] == {} and pooled["ratios"] == {}
    assert pooled["cpu_targets"]["ours_over_torchrun"]["verdict"] == "missed"  # CPU per step ~1.1 x


def test_torchrun_with_one_process_trains_the_bare_model_as_the_ray_launchers_do(monkeypatch):
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    try:
        device, wrap = step_overhead._setup({"launcher": "torchrun", "device": "cpu"})
        model = torch.nn.Linear(2, 2)
        assert device.type == "cpu" and wrap(model) is model  # Ray's prepare_model skips DDP at world size 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_strategy_row_takes_the_largest_rank_and_keeps_missing_chip_figures_missing():
    ranks = [{"state_bytes": 10, "param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 2, "device_allocated_bytes": 12,
              "device_peak_bytes": 30, "device_total_bytes": 32 * 2**30, "peak_rss_bytes": 100,
              "peak_rss_before_model_bytes": 60},
             {"state_bytes": 11, "param_bytes": 5, "grad_bytes": 4, "optimizer_bytes": 2, "device_allocated_bytes": 13,
              "device_peak_bytes": 25, "device_total_bytes": 32 * 2**30, "peak_rss_bytes": 90,
              "peak_rss_before_model_bytes": 20}]
    row = strategy_memory.strategy_row("fsdp2", ranks)
    assert (row["max_state_bytes"], row["max_device_allocated_bytes"], row["max_device_peak_bytes"],
            row["max_rss_growth_bytes"]) == (11, 13, 30, 70)
    host_only = [{**r, "device_allocated_bytes": None, "device_peak_bytes": None, "device_total_bytes": None}
                 for r in ranks]
    assert strategy_memory.strategy_row("ddp", host_only)["max_device_peak_bytes"] is None
