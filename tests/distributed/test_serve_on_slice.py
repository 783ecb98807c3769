"""Ray Serve LLM's own vLLM engine across a whole simulated slice, and
vllm-torchtpu's own Ray executor on the other one.

Two simulated v4 2x2x2 slices (2 hosts x 4 chips each) and one OpenAI app for
the module on one of them: a tiny random-initialised Llama (8 heads, 2 layers,
float32) spread over the 8 devices as TP 4 x PP 2 (tensor parallel on each
host, the two pipeline stages on the two hosts; one vLLM worker per chip,
gloo) in vLLM's compiled mode (the mode the config allows for pipeline
parallelism in simulation), compared token for token with the same model in
vLLM on one worker, offline. On the second slice, vllm-torchtpu 0.29.0's Ray
executor (fetched from PyPI) starts its workers with our hooks, its TPU
workers replaced by recorders. SmolLM2 answers for real in
test_serve_replicas.py.
"""

import json
import re
import time
import urllib.error
import urllib.request

import pytest
import ray

from ray_train_tpu.launch_env import launch_env
from ray_train_tpu.testing import alive_actors, free_port, simulated_tpu_cluster
from ray_train_tpu.topology import Topology
from tests.offline_reference import OfflineReference

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL, MODEL_ID = "2x2x2", "TPU-V4", "tiny8"
TP, PP = 4, 2
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Paris is the capital of"
MAX_TOKENS = 12
# Compiled (no enforce_eager): pipeline parallelism in eager mode cannot serve on
# vLLM's CPU backend, and build_llm_config refuses it (tests/unit/test_serve_config.py).
ENGINE = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20}

_OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
model, messages, prompt, n, engine = json.loads(sys.argv[1])
llm = LLM(model, tensor_parallel_size=1, **engine)
greedy = SamplingParams(temperature=0, max_tokens=n)
chat = llm.chat(messages, greedy)[0].outputs[0]
comp = llm.generate([prompt], greedy)[0].outputs[0]
print("RESULT " + json.dumps({"chat": list(chat.token_ids), "chat_text": chat.text,
                              "completion": list(comp.token_ids)}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from ray_train_tpu.serve import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("models") / MODEL_ID), num_attention_heads=8,
                           num_key_value_heads=8)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """Greedy tokens of the same model in vLLM on one worker, offline."""
    ref = OfflineReference(_OFFLINE, [model_dir, MESSAGES, PROMPT, MAX_TOKENS, ENGINE],
                           tmp_path_factory.mktemp("reference"))
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def single_worker(reference):
    return reference.result()


@pytest.fixture(scope="module")
def sim(reference):  # the reference starts first, and runs while the cluster and the app start
    with simulated_tpu_cluster(TOPOLOGY, ACCEL, num_slices=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def torchtpu_run(sim, tmp_path_factory):
    """vllm-torchtpu's executor on a free slice (see `_TORCHTPU`), started before
    the app and run while it starts."""
    run = OfflineReference(_TORCHTPU, {"address": sim.address, "topology": TOPOLOGY, "accelerator_type": ACCEL},
                           tmp_path_factory.mktemp("torchtpu"))
    yield run
    run.close()


@pytest.fixture(scope="module")
def base_url(sim, model_dir, torchtpu_run):
    from ray import serve

    from ray_train_tpu.serve import build_llm_config, build_openai_app

    port = free_port()
    # Multi-node simulated cluster: one proxy, on the head, on a free loopback port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    config = build_llm_config(model_dir, TOPOLOGY, ACCEL, model_id=MODEL_ID, engine_kwargs=ENGINE,
                              tensor_parallel_size=TP, pipeline_parallel_size=PP)
    t0 = time.monotonic()
    serve.run(build_openai_app([config]), name="llm", route_prefix="/")
    print(f"app up in {time.monotonic() - t0:.0f} s")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _post(url: str, body: dict, timeout: float = 300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()


def _chat(base_url, **extra):
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return _post(f"{base_url}/v1/chat/completions", body)


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _pgs(state=None) -> list:
    table = ray.util.placement_group_table().values()
    return [pg for pg in table if state is None or pg["state"] == state]


def _rank(name: str) -> int:
    """vLLM's rank from its worker actor's name, ``vllm_Worker_<id>_TP<t>_PP<p>``."""
    parts = dict(re.findall(r"_(TP|PP)(\d+)", name))
    return int(parts.get("PP", 0)) * TP + int(parts.get("TP", 0))


def _vllm_workers() -> list:
    """vLLM's Ray workers, with their host."""
    from ray.util.state import list_actors

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return [{"rank": _rank(a.name), "ip": ips[a.node_id]}
            for a in actors if (a.name or "").startswith("vllm_Worker_")]


def _serving_slice(sim) -> int:
    ips = {w["ip"] for w in _vllm_workers()}
    (slice_id,) = {s for (s, _), ip in sim.hosts.items() if ip in ips}
    return slice_id


def test_every_host_holds_workers_in_tpu_worker_id_order(sim, base_url):
    workers = sorted(_vllm_workers(), key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == list(range(8))
    hosts = [sim.hosts[(_serving_slice(sim), w)] for w in range(2)]
    # Rank r on TPU worker r // 4 (pipeline stage r // 4, TP rank r % 4): torch_tpu's
    # order, whatever Ray's bundle order was; one slice, never both.
    assert [w["ip"] for w in workers] == [hosts[r // 4] for r in range(8)]
    created = [pg for pg in _pgs("CREATED") if any(b.get("TPU") for b in pg["bundles"].values())]
    assert len(created) == 1 and [b["TPU"] for b in created[0]["bundles"].values()] == [1] * 8


def test_workers_got_the_launch_env(sim, base_url):
    from ray import serve

    handle = serve.get_deployment_handle(f"LLMServer:{MODEL_ID}", app_name="llm")
    described = handle.collective_rpc.remote(method="slice_env", timeout=60).result(timeout_s=120)
    topo = Topology.parse(TOPOLOGY, ACCEL)
    hosts = [sim.hosts[(_serving_slice(sim), w)] for w in range(2)]
    assert sorted(d["rank"] for d in described) == list(range(8))
    session = described[0]["env"]["TORCH_TPU_XPROF_SESSION_ID"]
    for d in described:
        assert d["node_ip"] == hosts[d["rank"] // 4]
        assert d["env"] == launch_env(topo, hosts, rank=d["rank"], xprof_session_id=session)


def test_greedy_over_the_slice_equals_one_worker_token_for_token(base_url, single_worker):
    status, _, text = _chat(base_url, return_token_ids=True)
    assert status == 200, text
    body = json.loads(text)
    choice = body["choices"][0]
    assert choice["token_ids"] == single_worker["chat"]
    assert choice["message"]["content"] == single_worker["chat_text"]
    assert body["usage"]["completion_tokens"] == MAX_TOKENS == len(choice["token_ids"])
    assert body["system_fingerprint"].endswith(body["system_fingerprint"].split("-")[-1])
    status, _, text = _post(f"{base_url}/v1/completions", {"model": MODEL_ID, "prompt": PROMPT,
                                                            "max_tokens": MAX_TOKENS, "temperature": 0,
                                                            "return_token_ids": True})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["token_ids"] == single_worker["completion"]


def test_streaming_equals_non_streaming(base_url):
    status, _, text = _chat(base_url)
    assert status == 200, text
    plain = json.loads(text)["choices"][0]["message"]["content"]
    status, ctype, text = _chat(base_url, stream=True)
    assert status == 200 and ctype.startswith("text/event-stream"), text
    chunks = _sse(text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(chunks) > 2  # token by token, not one piece
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == plain
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, _, text = _post(f"{base_url}/v1/completions", body)
    assert status == 200, text
    plain = json.loads(text)
    assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] == MAX_TOKENS
    status, ctype, text = _post(f"{base_url}/v1/completions", {**body, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream"), text
    assert "".join(c["choices"][0]["text"] for c in _sse(text)) == plain["choices"][0]["text"]


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", {"model": "no-such-model", "messages": MESSAGES}, 404),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 10_000}, 400),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "hi", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "hi", "temperature": -1}, 400),
    ],
    ids=["unknown-model", "longer-than-the-context", "max-tokens-negative", "temperature-negative"],
)
def test_bad_requests_get_openai_errors(base_url, path, body, status):
    got, ctype, text = _post(base_url + path, body)
    assert got == status, text
    error = json.loads(text)["error"]
    assert {"message", "type", "code"} <= set(error) and error["message"]
    assert int(error["code"]) == status


# Runs in a process of its own (torch_tpu registers the "tpu" device on import):
# vllm-torchtpu 0.29.0's RayDistributedExecutorV2, imported from the wheel with jax
# replaced, starts one worker per chip of a slice we reserve and lay out as a
# replica does, on this cluster, with our hooks installed; only its TPU worker
# (vLLM's RayWorkerProc, whose device would start) is a recorder, which runs our
# worker check as SliceWorkerProc does, on the environment their executor computed.
_TORCHTPU = """
import json, sys, types
cfg = json.loads(sys.argv[1])
import ray
from ray_train_tpu.testing.simulated_cluster import HEAD_IP
ray.init(address=cfg["address"], _node_ip_address=HEAD_IP, logging_level="ERROR")
from ray_train_tpu.serve import _torchtpu_source
executor = _torchtpu_source.import_executor(_torchtpu_source.source_dir())
from ray.util.tpu import SlicePlacementGroup
from ray_train_tpu._compat import vllm_torchtpu as T
from ray_train_tpu.serve import platforms
from ray_train_tpu.serve._layout import lay_out
from ray_train_tpu.topology import Topology

class RecordingProc:  # in place of vLLM's RayWorkerProc, which would start a TPU worker
    READY_STR = "READY"
    def __init__(self, vllm_config, rank, input_shm_handle, is_driver_worker, is_driver_node=False):
        self.rank = rank
    def get_node_and_physical_gpu_ids(self):
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), [int(c) for c in ctx.get_accelerator_ids()["TPU"]]
    def create_dist_init_method(self):
        return "tcp://" + ray.util.get_node_ip_address() + ":29400"
    def initialize_worker(self, local_rank, env_vars, distributed_init_method, driver_env_vars=None,
                          assigned_physical_gpu_ids=None):
        from ray_train_tpu import _environ
        from ray_train_tpu.serve.worker_check import slice_worker_setup
        engine_env = {**(driver_env_vars or {}), **_environ.copy(), **env_vars}
        extra = slice_worker_setup(self.rank, local_rank, engine_env, simulated=False)
        self.got = {"rank": self.rank, "local_rank": local_rank, "env": env_vars, "extra": extra,
                    "ip": ray.util.get_node_ip_address()}
    def wait_for_init(self):
        return {"status": "recorded"}
    def report(self):
        return self.got

topo = Topology.parse(cfg["topology"], cfg["accelerator_type"])
handle = SlicePlacementGroup(topology=topo.name, accelerator_version=topo.accelerator_type,
                             resources_per_bundle={"TPU": 1}, strategy="SPREAD")
plan = lay_out(handle.placement_group, topo)
import os
os.environ["TORCH_TPU_TOPOLOGY"] = topo.torch_tpu_topology  # as build_llm_config gives a replica on TPUs
cls = executor.RayDistributedExecutorV2
theirs = cls._slice_host_layout(None, "TPU")
T.confine_executor(cls, platforms._engine_slice_layout)
confined = cls._slice_host_layout(None, "TPU")
import vllm.v1.executor.ray_executor_v2 as v2
v2.RayWorkerProc = RecordingProc
pc = types.SimpleNamespace(
    world_size=topo.num_devices, tensor_parallel_size=topo.num_devices, pipeline_parallel_size=1,
    prefill_context_parallel_size=1, data_parallel_size=1, data_parallel_index=0, nnodes_within_dp=1,
    local_world_size=topo.num_devices, placement_group=handle.placement_group, ray_runtime_env=None,
    ray_workers_use_nsight=False, enable_expert_parallel=False)
ex = object.__new__(cls)
ex.vllm_config, ex.parallel_config = types.SimpleNamespace(parallel_config=pc, instance_id="probe"), pc
try:
    ex._init_executor()
    stopped = None
except RuntimeError as e:
    stopped = str(e)
workers = ray.get([h.actor.report.remote() for h in ex.ray_worker_handles])
print("RESULT " + json.dumps({"plan": plan.to_json(), "theirs": theirs, "confined": confined,
                              "stopped": stopped, "workers": workers}))
handle.shutdown()
"""


def test_vllm_torchtpu_executor_with_our_hooks_gives_each_worker_launch_env(sim, base_url, torchtpu_run):
    """vllm-torchtpu's own executor code: unconfined it takes every TPU node of the
    cluster as the slice (here both slices, one of them serving); confined by our
    plugin, the environment it computes for each worker is launch_env's, and our
    worker check passes in every worker."""
    from ray_train_tpu.serve.slice_plan import ENGINE_SET_KEYS, SlicePlan

    got = torchtpu_run.result()
    plan = SlicePlan.from_json(got["plan"])
    every_host = sorted(sim.hosts.values())
    assert sorted(got["theirs"][0]) == every_host and len(every_host) == 4  # the problem: two slices mixed
    assert got["confined"] == [list(plan.hosts), {ip: 4 for ip in plan.hosts}]
    # One whole slice, its hosts in worker-id order. Which one depends on timing: the
    # probe runs while the app starts, and may finish before the app takes its slice.
    assert list(plan.hosts) in [[sim.hosts[(s, w)] for w in range(2)] for s in range(2)]
    assert got["stopped"] and "recorded" in got["stopped"]  # stopped where a TPU worker would start
    topo = Topology.parse(TOPOLOGY, ACCEL)
    assert sorted(w["rank"] for w in got["workers"]) == list(range(8))
    for w in got["workers"]:
        ours = launch_env(topo, list(plan.hosts), rank=w["rank"], xprof_session_id="any")
        theirs = {k: w["env"][k].replace("x", ",") for k in ENGINE_SET_KEYS}
        assert theirs == {k: ours[k] for k in ENGINE_SET_KEYS}, w
        assert w["ip"] == plan.hosts[w["rank"] // 4] and w["local_rank"] == w["rank"] % 4
        assert w["extra"] == {}  # on a TPU vllm-torchtpu's values stand, once checked


def test_teardown_leaves_no_placement_group_or_actor(sim, base_url):
    from ray import serve

    from ray_train_tpu._compat.ray_llm import TELEMETRY_ACTOR_CLASS

    assert len(_vllm_workers()) == 8 and _pgs("CREATED")  # there is something to tear down
    serve.shutdown()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        live_pgs = [pg for pg in _pgs() if pg["state"] != "REMOVED"]
        # Ray Serve LLM's usage-telemetry actor is detached (Ray's design, holds nothing).
        actors = [a for a in alive_actors() if a["class_name"] != TELEMETRY_ACTOR_CLASS]
        if not live_pgs and not actors:
            break
        time.sleep(1)
    assert live_pgs == [] and actors == []


# --- batch engines on pieces of a slice (issue 33 item 3), once the whole-slice app is gone ---

BATCH_PIECE_ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                      "kv_cache_memory_bytes": 32 * 2**20}


def test_batch_on_one_chip_pieces_of_a_slice_equals_one_worker(sim, model_dir, single_worker):
    """Two one-chip engines on one 2x2x2 slice (engine_shape 1x1x1,
    engines_per_slice=2): each holds its chip in its own actor and runs vLLM's
    worker in its engine core (no vLLM worker actors), both on one host (best
    fit), every row once and equal to one worker's greedy tokens."""
    from ray.util.state import list_actors

    from ray_train_tpu.serve.batch import BatchConfig, SliceBatchProcessor

    _wait_for("the whole-slice app's slices released", lambda: not [
        pg for pg in _pgs() if pg["state"] != "REMOVED" and any(b.get("TPU") for b in pg["bundles"].values())], 90)
    config = BatchConfig(model=model_dir, topology=TOPOLOGY, accelerator_type=ACCEL, engine_shape="1x1x1",
                         engines_per_slice=2, max_tokens=MAX_TOKENS, batch_size=2, max_concurrent_batches=1,
                         engine_kwargs=BATCH_PIECE_ENGINE)
    ds = ray.data.from_items([{"id": i, "prompt": PROMPT} for i in range(8)], override_num_blocks=4)
    t0 = time.monotonic()
    with SliceBatchProcessor(config) as processor:
        rows = list(processor(ds).iter_rows())
        groups = [pg for pg in _pgs("CREATED") if any(b.get("TPU") for b in pg["bundles"].values())]
        engines = [a for a in list_actors(limit=1000, detail=True) if "SliceEngineUDF" in (a.class_name or "")]
        ours = {pg["placement_group_id"] for pg in groups}
        vllm_workers = [a for a in list_actors(limit=1000, detail=True)
                        if "WorkerProc" in (a.class_name or "") and a.placement_group_id in ours]
    print(f"batch on two one-chip pieces: {len(rows)} rows in {time.monotonic() - t0:.0f} s")
    assert sorted(r["id"] for r in rows) == list(range(8))
    assert all(list(r["generated_token_ids"]) == single_worker["completion"] for r in rows), rows[0]
    assert {r["slice"] for r in rows} <= {"sim-slice-0", "sim-slice-1"} and len({r["slice"] for r in rows}) == 1
    assert sorted(len(pg["bundles"]) for pg in groups) == [1, 1], [(pg["name"], pg["bundles"]) for pg in groups]
    assert len({n for pg in groups for n in pg["bundles_to_node_id"].values()}) == 1  # best fit: one host
    assert len(engines) == 2 and vllm_workers == [], (engines, vllm_workers)
    # Each engine actor held its chip itself (Ray gave it one TPU id: worker_check.check_chip_engine),
    # and its worker ran in its engine core ("uni", vllm-torchtpu's executor for one device), not in
    # a process of vLLM's multiprocess executor (vLLM's CPU platform's own choice).
    logs = _engine_logs("one-chip engine on slice")
    assert len(logs) == 2 and not [f for f, text in logs.items() if "multiproc_executor.py" in text], sorted(logs)
    _wait_for("nothing reserved", lambda: not [pg for pg in _pgs() if pg["state"] != "REMOVED"], 60)


def _engine_logs(marker: str) -> dict:
    """The worker logs (stderr) of this cluster's session that contain `marker`, by file."""
    import glob
    import os

    logs = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    found = {}
    for path in glob.glob(os.path.join(logs, "worker-*.err")):
        with open(path, errors="replace") as f:
            text = f.read()
        if marker in text:
            found[os.path.basename(path)] = text
    return found


# --- replicas on sub-slices (issue 33 item 2), on the same cluster once the whole-slice app is gone ---

SUB_APP = "sub"
# Eager: four one-chip engines and one TP 4 engine start in well under a minute.
SUB_ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 32 * 2**20}


def _sub_deployment(model_id: str) -> str:
    from ray import serve

    app = serve.status().applications.get(SUB_APP)
    names = [n for n in (app.deployments if app else {}) if n.endswith(":" + model_id)]
    return names[0] if names else ""


def _sub_replicas(model_id: str) -> dict:
    from ray import serve

    name = _sub_deployment(model_id)
    if not name:
        return {}
    states = serve.status().applications[SUB_APP].deployments[name].replica_states
    return {str(k): v for k, v in states.items()}


def _wait_for(what, cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(1)


@pytest.fixture(scope="module")
def sub_app(sim, model_dir):
    """One app on one 2x2x2 slice: one TP 4 replica on a one-host 2x2x1 sub-slice
    (Ray's SubslicePlacementGroup) and four one-chip replicas on the other host.
    The other slice is held meanwhile, so the app has exactly one slice to fill.
    Ray discovers the slice's sub-slices first (its discovery needs the slice idle
    once; docs/serving.md), through the same function the replicas use."""
    from ray import serve
    from ray.util.tpu import SlicePlacementGroup

    from ray_train_tpu.rl.slices import reserve_subslice
    from ray_train_tpu.serve import build_llm_config, build_openai_app

    _wait_for("the whole-slice app's slices released", lambda: not [
        pg for pg in _pgs() if pg["state"] != "REMOVED" and any(b.get("TPU") for b in pg["bundles"].values())], 90)
    other = SlicePlacementGroup(topology=TOPOLOGY, accelerator_version=ACCEL, resources_per_bundle={"TPU": 1})
    ray.get(other.placement_group.ready(), timeout=60)
    held = set(ray.util.placement_group_table(other.placement_group)["bundles_to_node_id"].values())
    host = Topology.parse("2x2x1", ACCEL)
    warm = reserve_subslice(host, resources_per_bundle={"TPU": 4}, name="discover", simulated=True)
    ray.get(warm.placement_group.ready(), timeout=60)
    warm.shutdown()
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    tp4 = build_llm_config(model_dir, TOPOLOGY, ACCEL, model_id="tiny8-tp4", engine_shape="2x2x1", num_replicas=1,
                           engine_kwargs=SUB_ENGINE)
    chips = build_llm_config(model_dir, TOPOLOGY, ACCEL, model_id="tiny8-chip", engine_shape="1x1x1", num_replicas=4,
                             engine_kwargs=SUB_ENGINE)
    t0 = time.monotonic()
    serve.run(build_openai_app([tp4, chips]), name=SUB_APP, route_prefix="/")
    print(f"sub-slice app up in {time.monotonic() - t0:.0f} s")
    try:
        yield {"url": f"http://127.0.0.1:{port}", "held": held}
    finally:
        serve.shutdown()
        other.shutdown()


def _completion(url, model_id):
    status, _, text = _post(f"{url}/v1/completions", {"model": model_id, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "return_token_ids": True}, timeout=120)
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"]


def _answers(url, model_id, n):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _completion(url, model_id), range(n)))


def test_one_slice_as_four_one_chip_replicas_and_one_tp4_replica_answers_alike(sim, sub_app):
    created = [pg for pg in _pgs("CREATED") if any(b.get("TPU") for b in pg["bundles"].values())]
    ours = [pg for pg in created if not set(pg["bundles_to_node_id"].values()) <= sub_app["held"]]
    # Five groups of one chip per bundle: 4 x 1 chip and 1 x 4 chips, each on one host, the slice full.
    assert sorted(len(pg["bundles"]) for pg in ours) == [1, 1, 1, 1, 4]
    hosts = [set(pg["bundles_to_node_id"].values()) for pg in ours]
    assert all(len(h) == 1 for h in hosts) and len(set().union(*hosts)) == 2
    assert not set().union(*hosts) & sub_app["held"]
    one_chip = _answers(sub_app["url"], "tiny8-chip", 8)  # concurrent: spread over the four replicas
    tp4 = _completion(sub_app["url"], "tiny8-tp4")
    assert len(tp4) == MAX_TOKENS and all(a == tp4 for a in one_chip), (tp4, one_chip)


def test_a_killed_one_chip_replica_leaves_the_others_serving_and_is_replaced(sim, sub_app):
    """Its replica actor is killed, not its host: the four one-chip replicas share
    one host, whose loss would take all four (and the cluster's host) down."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from ray.util.state import list_actors

    want = _completion(sub_app["url"], "tiny8-tp4")
    replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
                if "tiny8-chip" in (a.class_name or "") and "ServeReplica" in (a.class_name or "")]
    assert len(replicas) == 4, [a.class_name for a in replicas]
    groups = len([pg for pg in _pgs("CREATED") if len(pg["bundles"]) == 1])
    with ThreadPoolExecutor(8) as pool:
        os.kill(replicas[0].pid, signal.SIGKILL)
        # Sent after the kill, before Serve has noticed it: every one must be answered.
        after = list(pool.map(lambda _: _completion(sub_app["url"], "tiny8-chip"), range(12)))
    assert all(a == want for a in after)
    # Its chip went with it (the group fate-shares with the replica); Serve's new replica
    # reserves one again (its engine's start is not waited for: a minute of CPU here).

    def replaced():
        alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
                 if "tiny8-chip" in (a.class_name or "") and "ServeReplica" in (a.class_name or "")]
        return (len(alive) == 4 and replicas[0].actor_id not in {a.actor_id for a in alive}
                and len([pg for pg in _pgs("CREATED") if len(pg["bundles"]) == 1]) == groups)

    _wait_for("the replacement replica on a free chip", replaced, 240)
