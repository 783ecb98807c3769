"""One slice per replica, and one slice per batch engine, on the cluster that
``python -m ray_train_tpu serve --simulate`` starts itself: two simulated
one-chip v6e slices (one-chip slices keep this module's memory small; the
multi-host slice is test_serve_on_slice.py's).

- The CLI serves SmolLM2-135M-Instruct with autoscaling between 1 and 2
  replicas; the ``openai`` client gets real answers ("Paris"), streaming and
  not. Under load the app scales 1 -> 2 (the second replica waits while its
  slice is held elsewhere, then takes it whole) and back to 1 when the load
  stops, releasing that slice.
- Then, on the same two slices, batch inference with Ray Data LLM: 200
  prompts through two engines (a tiny random Llama), greedy output equal to
  offline ``vllm.LLM`` token for token, no row lost or duplicated while one
  engine is killed mid-run, nothing left reserved afterwards.
- Ctrl-C stops the CLI cleanly.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray

from ray_train_tpu.testing import alive_actors, free_port
from tests.offline_reference import OfflineReference

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL, MODEL_ID = "1x1", "TPU-V6E", "smollm2"
APP, DEPLOYMENT = "llm", f"LLMServer:{MODEL_ID}"
# float32: in bfloat16 this 135M model answers "L'Étoile, la Marseillaise, ..." (vLLM offline too).
SERVE_ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
               "downscale_delay_s": 2, "look_back_period_s": 1}
BATCH_ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 32 * 2**20}
NUM_PROMPTS, BATCH_TOKENS = 200, 8
PROMPTS = [f"Prompt {i}: the number {i * 7} is" for i in range(NUM_PROMPTS)]
START_TIMEOUT_S = 900
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

_OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
model, prompts, n, engine = json.loads(sys.argv[1])
outs = LLM(model, tensor_parallel_size=1, **engine).generate(prompts, SamplingParams(temperature=0, max_tokens=n))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from ray_train_tpu.serve import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny8"), num_attention_heads=8,
                           num_key_value_heads=8)


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """Greedy tokens of every prompt from vLLM offline on one worker."""
    ref = OfflineReference(_OFFLINE, [tiny_dir, PROMPTS, BATCH_TOKENS, BATCH_ENGINE],
                           tmp_path_factory.mktemp("reference"))
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def offline_tokens(reference):
    return reference.result()


class Served:
    def __init__(self, proc, port, address, log):
        self.proc, self.url, self.address, self.log = proc, f"http://127.0.0.1:{port}/v1", address, log


@pytest.fixture(scope="module")
def served(reference, tmp_path_factory):  # the reference starts first and runs meanwhile
    """The CLI, serving on the simulated cluster it started; this process joins that cluster."""
    from ray_train_tpu.testing.simulated_cluster import HEAD_IP

    port = free_port()
    log = tmp_path_factory.mktemp("cli") / "serve.stderr"
    cmd = [sys.executable, "-m", "ray_train_tpu", "serve", "--model", "smollm2", "--topology", TOPOLOGY,
           "--accelerator-type", ACCEL, "--simulate", "--port", str(port),
           "--autoscaling-config", json.dumps(AUTOSCALING), "--engine-kwargs", json.dumps(SERVE_ENGINE)]
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    line = _read_line(proc, START_TIMEOUT_S)
    assert line.startswith("serving at http://127.0.0.1:") and "SIMULATED" in line, (line, _tail(log))
    address = line.split("on the Ray cluster at ")[1].split(";")[0]
    print(f"serve --simulate up in {time.monotonic() - t0:.0f} s: {line.strip()}")
    saved = os.environ.get("RAY_TRAIN_TPU_SIMULATE")
    os.environ["RAY_TRAIN_TPU_SIMULATE"] = "1"  # this process imports vLLM (Ray Data LLM) too
    ray.init(address=address, _node_ip_address=HEAD_IP, logging_level="WARNING")
    try:
        yield Served(proc, port, address, log)
    finally:
        ray.shutdown()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.environ.pop("RAY_TRAIN_TPU_SIMULATE") if saved is None else os.environ.update(RAY_TRAIN_TPU_SIMULATE=saved)


def _read_line(proc, timeout_s: float) -> str:
    got = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return got[0] if got else f"(no line within {timeout_s:.0f} s; exit status {proc.poll()})"


def _tail(path, n=4000) -> str:
    with open(path) as f:
        return f.read()[-n:]


def _replicas() -> dict:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments[DEPLOYMENT].replica_states.items()}


def _tpu_pgs(state: str = "CREATED") -> list:
    return [pg for pg in ray.util.placement_group_table().values()
            if pg["state"] == state and any(b.get("TPU") for b in pg["bundles"].values())]


def _wait(what: str, cond, timeout_s: float, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s (replicas {_replicas()})"
        time.sleep(every_s)


def test_openai_client_gets_real_answers_streaming_and_not(served):
    import openai

    client = openai.OpenAI(base_url=served.url, api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    chat = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer and chat.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == answer  # token by token, the same text
    done = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)


def test_autoscaling_takes_a_whole_slice_under_load_and_releases_it(served):
    import openai
    from ray.util.tpu import SlicePlacementGroup

    assert _replicas() == {"RUNNING": 1} and len(_tpu_pgs()) == 1
    client = openai.OpenAI(base_url=served.url, api_key="unused")
    stop, errors = threading.Event(), []

    def load():
        while not stop.is_set():
            try:
                client.completions.create(model=MODEL_ID, prompt="Count: one, two,", max_tokens=48, temperature=0)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    # The free slice is held elsewhere first: the new replica must wait for it, whole.
    other = SlicePlacementGroup(topology=TOPOLOGY, accelerator_version=ACCEL, resources_per_bundle={"TPU": 1})
    ray.get(other.placement_group.ready(), timeout=60)
    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        _wait("a second replica is asked for", lambda: sum(_replicas().values()) == 2, 120)
        time.sleep(3)
        assert _replicas().get("RUNNING") == 1 and len(_tpu_pgs()) == 2  # ours, the app's; no third
        other.shutdown()
        _wait("1 -> 2 replicas", lambda: _replicas() == {"RUNNING": 2}, START_TIMEOUT_S, every_s=2)
        pgs = _tpu_pgs()
        nodes = [set(pg["bundles_to_node_id"].values()) for pg in pgs]
        assert len(pgs) == 2 and nodes[0].isdisjoint(nodes[1])  # one whole slice each
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors[:3]
    _wait("2 -> 1 replicas", lambda: _replicas() == {"RUNNING": 1} and len(_tpu_pgs()) == 1, 180, every_s=2)


def test_batch_on_both_slices_equals_offline_and_survives_a_killed_engine(served, tiny_dir, offline_tokens):
    from ray import serve
    from ray.util.state import list_actors

    from ray_train_tpu.serve.batch import BatchConfig, SliceBatchProcessor

    serve.delete(APP)  # the slices are the batch job's now
    _wait("the app's slice released", lambda: not _tpu_pgs(), 120)
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)], override_num_blocks=25)
    config = BatchConfig(model=tiny_dir, topology=TOPOLOGY, accelerator_type=ACCEL, num_slices=2,
                         max_tokens=BATCH_TOKENS, batch_size=8, max_concurrent_batches=2, engine_kwargs=BATCH_ENGINE)
    rows, killed = [], None
    t0 = time.monotonic()
    with SliceBatchProcessor(config) as processor:
        for row in processor(ds).iter_rows():
            rows.append(row)
            if killed is None:  # once both engines are up (one may start later on a busy machine): kill one
                engines = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
                           if "SliceEngineUDF" in a.class_name]
                if len(engines) == 2:
                    killed = engines[0]
                    os.kill(killed.pid, signal.SIGKILL)
        elapsed = time.monotonic() - t0
        assert killed is not None, f"the second engine never came up while {len(rows)} rows were produced"
        assert len(_tpu_pgs()) == 2  # one slice per engine, until released
    print(f"batch: {len(rows)} rows in {elapsed:.0f} s, one of two engines killed after the first row")
    assert sorted(r["id"] for r in rows) == list(range(NUM_PROMPTS))  # none lost, none twice
    for r in rows:
        assert list(r["generated_token_ids"]) == offline_tokens[r["id"]], r
        assert r["num_generated_tokens"] == len(r["generated_token_ids"]) and r["num_input_tokens"] > 0
        assert r["prompt"] == PROMPTS[r["id"]]
    assert {r["slice"] for r in rows} == {"sim-slice-0", "sim-slice-1"}
    restarted = [a for a in list_actors(limit=1000, detail=True) if a.actor_id == killed.actor_id]
    assert restarted and restarted[0].num_restarts >= 1  # Ray restarted it (on its slice)
    _wait("nothing reserved", lambda: not [pg for pg in ray.util.placement_group_table().values()
                                           if pg["state"] != "REMOVED"], 60)
    # The engines shut down cleanly once the rows were done, before their slices were
    # taken back, and said no EngineDeadError doing so (issue 33).
    logs = _engine_logs()
    assert logs and any("[shutdown] MPClient: complete" in text for text in logs.values()), sorted(logs)
    assert not {f for f, text in logs.items() if "EngineDeadError" in text or "output_handler failed" in text}


def _engine_logs() -> dict:
    """The text of every worker log of this cluster's session that a batch engine wrote."""
    import glob

    logs_dir = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    by_worker: dict = {}
    for path in glob.glob(os.path.join(logs_dir, "worker-*")):  # .out and .err of one worker process
        with open(path, errors="replace") as f:
            by_worker[os.path.splitext(os.path.basename(path))[0]] = by_worker.get(
                os.path.splitext(os.path.basename(path))[0], "") + f.read()
    return {name: text for name, text in by_worker.items() if "SliceEngineUDF" in text}


def test_ctrl_c_stops_the_cli_and_its_cluster(served):
    from ray_train_tpu._compat.ray_llm import TELEMETRY_ACTOR_CLASS

    actors = [a for a in alive_actors() if a["class_name"] != TELEMETRY_ACTOR_CLASS]
    assert not [a for a in actors if "SliceEngineUDF" in a["class_name"] or "LLMServer" in a["class_name"]]
    ray.shutdown()
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(120) == 0, _tail(served.log)
