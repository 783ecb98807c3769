"""The CLI's two kinds of error (bad input: one line, exit 2; a failure while
running: what failed, the error's first lines and where, exit 1), and batch
inference's input checks, all before anything is reserved (no Ray, no vLLM)."""

import io
import json
import sys
import types

import pytest

from ray_train_tpu import cli
from ray_train_tpu.serve.batch import BatchConfig, SliceBatchProcessor

TINY = {"num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 2,
        "max_position_embeddings": 128, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def _command(func):
    """A CLI with one command, `probe`, whose run is `func(args, out)`."""
    def register(subparsers, add_slice_args):
        subparsers.add_parser("probe").set_defaults(func=func)

    return types.SimpleNamespace(register=register, __name__="probe")


def _run(monkeypatch, func):
    monkeypatch.setattr(cli, "command_modules", lambda: [_command(func)])
    out, err = io.StringIO(), io.StringIO()
    return cli.main(["probe"], out=out, err=err), err.getvalue()


def _deep_failure():
    def inner():
        raise ValueError("Bundle index 7 not found in placement group bundles: [0, 1]\nsecond line\nthird")
    inner()


def test_bad_input_is_one_line_and_exit_2(monkeypatch):
    def run(args, out):
        raise ValueError("topology '4x5' is not a TPU-V6E slice;\n  valid: 4x4")

    code, err = _run(monkeypatch, run)
    assert code == 2 and err == "ray_train_tpu: error: topology '4x5' is not a TPU-V6E slice; valid: 4x4\n"


def test_a_failure_while_running_shows_what_failed_and_where(monkeypatch):
    def run(args, out):
        with cli.running("batch inference"):
            _deep_failure()  # a ValueError, but raised while running: not bad input

    code, err = _run(monkeypatch, run)
    lines = err.splitlines()
    assert code == 1 and lines[0] == "ray_train_tpu: error: batch inference failed:"
    assert lines[1:4] == ["  ValueError: Bundle index 7 not found in placement group bundles: [0, 1]",
                          "  second line", "  third"]
    assert "where (innermost last):" in err and "in inner" in err and "test_serve_cli.py" in err
    assert len(lines) < 20  # short: the error's first lines and the innermost frames


def test_a_long_upstream_error_is_cut_to_its_first_lines(monkeypatch):
    def run(args, out):
        with cli.running("serving"):
            raise RuntimeError("\n".join(f"remote line {i}" for i in range(50)))

    code, err = _run(monkeypatch, run)
    assert code == 1 and "remote line 7" in err and "remote line 8" not in err and "(42 more lines)" in err


def test_ctrl_c_is_exit_130(monkeypatch):
    def run(args, out):
        raise KeyboardInterrupt

    assert _run(monkeypatch, run) == (130, "ray_train_tpu: interrupted\n")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--input", "/no/such.jsonl", "--output", "/tmp/o.jsonl"], ["--input", "is not a file"]),
        (["--input", "{csv}", "--output", "/tmp/o.jsonl"], ["must be a .jsonl file"]),
        (["--input", "{txt}", "--output", "/no/such/dir/o.jsonl"], ["directory", "does not exist"]),
        (["--input", "{txt}", "--output", "/tmp/o.jsonl", "--max-tokens", "128"],
         ["max_tokens=128", "below the model's context of 128 tokens"]),
        (["--input", "{txt}", "--output", "/tmp/o.jsonl", "--tensor-parallel-size", "3"],
         ["tensor_parallel_size 3", "4 devices"]),
        (["--input", "{txt}", "--output", "/tmp/o.jsonl", "--engine-kwargs", "[1]"], ["must be a JSON object"]),
    ],
    ids=["no-input", "not-jsonl", "no-output-dir", "max-tokens-beyond-context", "tp-does-not-fit",
         "engine-kwargs-not-object"],
)
def test_batch_cli_refuses_bad_input_before_starting_anything(model_dir, tmp_path, argv, words):
    txt = tmp_path / "prompts.txt"
    txt.write_text("hello\n")
    (tmp_path / "prompts.csv").write_text("prompt\nhello\n")
    argv = [a.format(csv=tmp_path / "prompts.csv", txt=txt) for a in argv]
    before = {m for m in ("ray", "vllm") if m in sys.modules}
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["batch", "--model", model_dir, "--topology", "2x2x1", "--accelerator-type", "v4", *argv],
                    out=out, err=err)
    line = err.getvalue()
    assert code == 2 and line.count("\n") == 1 and all(w in line for w in words), line
    assert {m for m in ("ray", "vllm") if m in sys.modules} == before


def test_batch_config_is_one_engine_per_whole_slice(model_dir):
    config = BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", num_slices=2, max_tokens=16,
                         sampling_params={"top_p": 0.9}, simulate=True)
    engine = config.engine
    assert (engine.spec.tensor_parallel_size, engine.spec.pipeline_parallel_size) == (8, 1)
    assert engine.engine_kwargs["distributed_executor_backend"] == "ray" and engine.strategy == "SPREAD"
    assert engine.env["RAY_TRAIN_TPU_SIMULATE"] == "1" and engine.env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] == "1"
    assert config.sampling == {"top_p": 0.9, "max_tokens": 16, "temperature": 0.0}
    one_host = BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4", simulate=True)
    assert one_host.engine.strategy == "STRICT_PACK"  # no slice label pins a one-host slice's bundles


def test_batch_engines_on_pieces_of_a_slice_follow_the_engine_shape(model_dir):
    chips = BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", num_slices=2, engine_shape="1x1x1",
                        simulate=True)
    # One chip per engine: the engine's own actor holds it, vLLM's worker runs in its engine
    # core (vllm-torchtpu's executor for one device without TPU_MULTIHOST_BACKEND).
    assert (chips.engines_per_slice, chips.num_engines, chips.engine.num_devices) == (8, 16, 1)
    assert chips.engine.chip_in_actor and chips.engine.engine_kwargs["distributed_executor_backend"] == "uni"
    assert "TPU_MULTIHOST_BACKEND" not in chips.engine.env and chips.engine.env["RAY_TRAIN_TPU_SIMULATE"] == "1"
    hosts = BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engine_shape="2x2x1",
                        engines_per_slice=1, simulate=True)
    assert (hosts.engines_per_slice, hosts.num_engines, hosts.engine.spec.tensor_parallel_size) == (1, 1, 4)
    assert not hosts.engine.chip_in_actor and hosts.engine.env["TPU_MULTIHOST_BACKEND"] == "ray"
    whole_chip = BatchConfig(model=model_dir, topology="1x1", accelerator_type="v6e", num_slices=2, simulate=True)
    assert whole_chip.engine.chip_in_actor and whole_chip.num_engines == 2  # a one-chip slice: one chip, in the actor
    with pytest.raises(ValueError, match=r"engines_per_slice=9\) must be an integer in 1..8.*at most 8 1x1x1"):
        BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engine_shape="1x1x1",
                    engines_per_slice=9, simulate=True)
    with pytest.raises(ValueError, match=r"engines_per_slice=2\) must be an integer in 1..1.*give engine_shape"):
        BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engines_per_slice=2, simulate=True)
    with pytest.raises(ValueError, match=r"engine_shape '2x2' is no piece.*valid: 1x1x1"):
        BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engine_shape="2x2", simulate=True)


def test_an_engine_holding_its_chip_asks_for_it_in_its_reservation(model_dir, monkeypatch):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ray_train_tpu.serve import batch, pieces

    asked = []

    def piece(spec, *, name, simulated, timeout_s=None):
        asked.append((spec.engine_shape, name, simulated, timeout_s))
        return f"pg-{len(asked)}"

    monkeypatch.setattr(pieces, "reserve_engine_slice", piece)
    chips = BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engine_shape="1x1x1",
                        simulate=True, reserve_timeout_s=30)
    args = batch.reserve_engine("job-y", chips.engine, timeout_s=30)
    assert args["resources"] == {"TPU": 1} and isinstance(args["scheduling_strategy"], PlacementGroupSchedulingStrategy)
    assert args["scheduling_strategy"].placement_group == "pg-1"
    assert args["scheduling_strategy"].placement_group_bundle_index == 0
    hosts = BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engine_shape="2x2x1", simulate=True)
    args = batch.reserve_engine("job-y", hosts.engine)
    assert "resources" not in args and args["scheduling_strategy"].placement_group_capture_child_tasks
    assert asked == [("1x1x1", "job-y-engine-0", True, 30), ("2x2x1", "job-y-engine-1", True, None)]
    assert batch.reservations("job-y") == 2
    batch._RESERVATIONS.pop("job-y")


def test_only_an_engine_actors_start_reserves_a_slice(model_dir, monkeypatch):
    """Ray Data's memory detector calls the stage's remote-args function too: no reservation then."""
    from ray_train_tpu._compat import ray_data as RD
    from ray_train_tpu.serve import batch

    made = []
    monkeypatch.setattr(batch, "reserve_engine", lambda job, engine, timeout_s=None: made.append(job) or {"x": 1})
    config = BatchConfig(model=model_dir, topology="1x1", accelerator_type="v6e", simulate=True)
    assert batch.engine_remote_args("job-z", config.engine) == {} and made == []
    namespace: dict = {}
    exec(compile("def _start_actor(fn):\n    return fn()\n", "/x/" + RD.ACTOR_START[0], "exec"), namespace)
    assert namespace["_start_actor"](lambda: batch.engine_remote_args("job-z", config.engine)) == {"x": 1}
    assert made == ["job-z"]


def test_a_piece_that_never_frees_fails_after_the_users_timeout(model_dir, monkeypatch):
    from ray_train_tpu.serve import pieces

    monkeypatch.setattr(pieces, "_try_part_of_host", lambda spec, name: None)
    monkeypatch.setattr(pieces, "RETRY_S", 0.01)
    chips = BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", engine_shape="1x1x1", simulate=True)
    with pytest.raises(TimeoutError, match=r"no free 1x1x1 piece of a TPU-V4 2x2x2 slice within 0.05 s"):
        pieces.reserve_engine_slice(chips.engine.spec, name="x", simulated=True, timeout_s=0.05)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"num_slices": 0}, ValueError, "num_slices=0"),
        ({"max_tokens": 0}, ValueError, "max_tokens=0"),
        ({"max_tokens": 64, "engine_kwargs": {"max_model_len": 64}}, ValueError, "context of 64 tokens"),
        ({"temperature": -1.0}, ValueError, "temperature=-1.0"),
        ({"prompt_column": ""}, TypeError, "prompt_column"),
        ({"sampling_params": {"max_tokens": 5}}, ValueError, "give them as BatchConfig fields"),
        ({"pipeline_parallel_size": 2, "engine_kwargs": {"enforce_eager": True}}, ValueError,
         "pipeline_parallel_size 2 with enforce_eager=True"),
        ({"engine_kwargs": {"distributed_executor_backend": "mp"}}, ValueError, "needs vLLM's Ray executor"),
    ],
)
def test_batch_config_refuses_what_cannot_run(model_dir, kwargs, error, words):
    with pytest.raises(error, match=words):
        BatchConfig(model=model_dir, topology="2x2x2", accelerator_type="v4", simulate=True, **kwargs)


def test_a_dataset_without_the_prompt_column_is_refused_before_anything_is_reserved(model_dir):
    class Dataset:
        def schema(self):
            return types.SimpleNamespace(names=["text", "id"])

    processor = SliceBatchProcessor(BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4",
                                                simulate=True))
    with pytest.raises(ValueError, match="no column 'prompt' \\(its columns: \\['text', 'id'\\]\\).*prompt_column"):
        processor(Dataset())
    assert processor.release() == 0  # nothing was reserved


def test_slices_are_released_only_once_their_engines_have_shut_down(monkeypatch):
    """A slice removed under a running engine kills its vLLM workers (an
    EngineDeadError): after a clean run, release waits until no actor runs in the
    job's placement groups; after an error it releases at once."""
    import ray.util.state

    from ray_train_tpu.serve import batch as B

    events, answers = [], [["engine", "worker"], ["worker"], []]

    def list_actors(**kwargs):
        alive = answers.pop(0) if answers else []
        events.append(f"listed {len(alive)}")
        return [types.SimpleNamespace(placement_group_id="pg0", name=n) for n in alive] + [
            types.SimpleNamespace(placement_group_id="other-job", name="x")]

    class Handle:
        placement_group = types.SimpleNamespace(id=types.SimpleNamespace(hex=lambda: "pg0"))

        def shutdown(self):
            events.append("removed")

    monkeypatch.setattr(ray.util.state, "list_actors", list_actors)
    monkeypatch.setattr(B.time, "sleep", lambda s: None)
    B._RESERVATIONS["job-a"] = [Handle()]
    assert B.release("job-a", wait_s=60) == 1
    assert events == ["listed 2", "listed 1", "listed 0", "removed"]
    events.clear()
    B._RESERVATIONS["job-b"] = [Handle()]
    processor = SliceBatchProcessor.__new__(SliceBatchProcessor)
    processor.job = "job-b"
    processor.__exit__(RuntimeError, RuntimeError("failed"), None)
    assert events == ["removed"]  # after an error: at once


@pytest.mark.parametrize(
    "lines, argv, words",
    [
        (['{"prompt": "hi"}', '{"text": "no prompt"}'], [], ["line 2 has no 'prompt' text", "['text']",
                                                           "--prompt-column"]),
        (['{"prompt": "hi"}'], ["--prompt-column", "question"], ["line 1 has no 'question' text"]),
        (['{"prompt": 3}'], [], ["line 1 has int 'prompt' text"]),
        (['{"prompt": "hi"}', "not json"], [], ["line 2 is not JSON"]),
        (['["hi"]'], [], ["line 1 is list, not a JSON object"]),
        (["", "  "], [], ["has no prompts"]),
    ],
    ids=["missing-column", "unknown-prompt-column", "not-text", "not-json", "not-object", "empty"],
)
def test_batch_cli_checks_every_input_line_before_starting_anything(model_dir, tmp_path, lines, argv, words):
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"
    before = {m for m in ("ray", "vllm") if m in sys.modules}
    err = io.StringIO()
    code = cli.main(["batch", "--model", model_dir, "--topology", "2x2x1", "--accelerator-type", "v4",
                     "--input", str(src), "--output", str(output), *argv], out=io.StringIO(), err=err)
    line = err.getvalue()
    assert code == 2 and line.count("\n") == 1 and all(w in line for w in words), line
    assert {m for m in ("ray", "vllm") if m in sys.modules} == before  # no cluster, no engine
    assert not output.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_batch_cli_refuses_a_column_a_text_file_does_not_have(model_dir, tmp_path):
    src = tmp_path / "prompts.txt"
    src.write_text("hello\n")
    err = io.StringIO()
    code = cli.main(["batch", "--model", model_dir, "--topology", "2x2x1", "--accelerator-type", "v4",
                     "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--prompt-column", "prompt"],
                    out=io.StringIO(), err=err)
    assert code == 2 and "a .txt input has one column, 'text'" in err.getvalue()


def test_a_failed_batch_run_leaves_no_partial_output(model_dir, tmp_path, monkeypatch):
    from ray_train_tpu.cli import batch as batch_cli
    from ray_train_tpu.serve import batch

    class Failing:
        def __init__(self, config):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def __call__(self, ds):
            def rows():
                yield {"prompt": "hi", "num_generated_tokens": 1}
                raise RuntimeError("engine died")
            return types.SimpleNamespace(iter_rows=rows)

    fake_ray = types.SimpleNamespace(data=types.SimpleNamespace(read_text=lambda path: "ds"))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(batch, "SliceBatchProcessor", Failing)
    src = tmp_path / "p.txt"
    src.write_text("hi\n")
    args = types.SimpleNamespace(input=str(src), output=str(tmp_path / "out.jsonl"))
    config = BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4", simulate=True)
    with pytest.raises(RuntimeError, match="engine died"):
        batch_cli._run(config, args, True, io.StringIO(), simulated=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "p.txt"]


def test_a_per_request_seed_is_refused_for_sampling_and_the_engine_seed_is_named(model_dir):
    with pytest.raises(ValueError, match=r"refuses a per-request seed.*engine_kwargs=\{'seed': 7\}"):
        BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4", simulate=True, temperature=0.8,
                    sampling_params={"seed": 7})
    greedy = BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4", simulate=True,
                         sampling_params={"seed": 7})  # greedy: vllm-torchtpu lets it through
    assert greedy.sampling["seed"] == 7
    assert "seed" not in BatchConfig.__doc__.split("sampling_params:")[1].split("No per-request")[0]
    with pytest.raises(ValueError, match="reserve_timeout_s=0"):
        BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4", simulate=True, reserve_timeout_s=0)


def test_reserve_slice_waits_as_long_as_the_user_said_and_names_it(monkeypatch):
    import ray.util.tpu

    from ray_train_tpu.serve import batch

    seen = {}

    class NoFreeHead:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise TimeoutError("Timed out waiting for TPU head")

    monkeypatch.setattr(ray.util.tpu, "SlicePlacementGroup", NoFreeHead)
    with pytest.raises(TimeoutError, match=r"no TPU-V4 2x2x2 slice head became free within "
                                           r"BatchConfig\(reserve_timeout_s=12.5\)"):
        batch.reserve_slice("job-x", "2x2x2", "TPU-V4", "SPREAD", timeout_s=12.5)
    assert seen["head_reservation_timeout_s"] == 12.5 and batch.reservations("job-x") == 0


def test_the_cluster_check_counts_idle_slices_not_intact_ones(model_dir, monkeypatch):
    import ray
    import ray.util.tpu

    from ray_train_tpu.serve import batch

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util.tpu, "get_num_tpu_slices", lambda topology, accelerator_type: 2)
    monkeypatch.setattr(ray.util.tpu, "get_num_ready_tpu_slices", lambda topology, accelerator_type: 1)
    monkeypatch.setattr(batch, "IDLE_SETTLE_S", 0.0)
    config = BatchConfig(model=model_dir, topology="2x2x1", accelerator_type="v4", num_slices=2, simulate=True)
    with pytest.raises(ValueError, match=r"needs 2 idle TPU-V4 2x2x1 slices, but the Ray cluster has 1 idle "
                                         r"\(of 2 intact"):
        batch._check_cluster(config)
    monkeypatch.setattr(ray.util.tpu, "get_num_ready_tpu_slices", lambda topology, accelerator_type: 2)
    batch._check_cluster(config)
