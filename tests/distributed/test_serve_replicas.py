"""One slice per replica: two simulated one-chip v6e slices, three replicas of
SmolLM2-135M-Instruct (Ray Serve LLM's vLLM engine, one worker each). Two
replicas run, each on its own slice; the third waits for a slice; the answer
is real ("Paris"). One-chip slices keep this module's memory small; the
multi-host slice is test_serve_on_slice.py's.
"""

import json
import time
import urllib.error
import urllib.request

import pytest
import ray

from ray_train_tpu.testing import alive_actors, free_port, simulated_tpu_cluster

pytestmark = pytest.mark.distributed

TOPOLOGY, ACCEL, MODEL_ID = "1x1", "TPU-V6E", "smollm2"
# float32: in bfloat16 this 135M model answers "L'Étoile, la Marseillaise, ..." (vLLM offline too).
DEPLOYMENT = f"LLMServer:{MODEL_ID}"
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}
START_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def sim():
    # 3 logical CPUs per host: a bundle's CPU, a replica, the ingress.
    with simulated_tpu_cluster(TOPOLOGY, ACCEL, num_slices=2, cpus_per_host=3) as cluster:
        yield cluster


def _replica_states() -> dict:
    from ray import serve

    app = serve.status().applications.get("llm")
    if app is None or DEPLOYMENT not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments[DEPLOYMENT].replica_states.items()}


@pytest.fixture(scope="module")
def base_url(sim):
    from ray import serve

    from ray_train_tpu.serve import build_llm_config, build_openai_app, smollm2_dir

    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    config = build_llm_config(smollm2_dir(), TOPOLOGY, ACCEL, model_id=MODEL_ID, num_replicas=3,
                              engine_kwargs=ENGINE)
    t0 = time.monotonic()
    # Not blocking: the app never becomes RUNNING (its third replica waits).
    serve._run(build_openai_app([config]), name="llm", route_prefix="/", _blocking=False)
    while _replica_states().get("RUNNING", 0) < 2:
        assert time.monotonic() - t0 < START_TIMEOUT_S, _replica_states()
        time.sleep(2)
    print(f"two replicas up in {time.monotonic() - t0:.0f} s")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def _post(url: str, body: dict, timeout: float = 300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _tpu_pgs(state: str) -> list:
    return [pg for pg in ray.util.placement_group_table().values()
            if pg["state"] == state and any(b.get("TPU") for b in pg["bundles"].values())]


def test_two_replicas_run_on_two_slices_and_share_no_host(sim, base_url):
    from ray.util.state import list_actors

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    workers = [ips[a.node_id] for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
               if (a.name or "").startswith("vllm_Worker_")]
    assert sorted(workers) == sorted(sim.hosts.values())  # one worker on each slice's host
    created = _tpu_pgs("CREATED")
    assert len(created) == 2
    hosts = [{ips[n] for n in pg["bundles_to_node_id"].values()} for pg in created]
    assert hosts[0].isdisjoint(hosts[1])


def test_a_third_replica_waits_for_a_slice(sim, base_url):
    deadline = time.monotonic() + 10  # it does not take part of a slice in the meantime
    while time.monotonic() < deadline:
        states = _replica_states()
        assert states.get("RUNNING") == 2 and sum(states.values()) == 3, states
        assert len(_tpu_pgs("CREATED")) == 2
        time.sleep(2)


def test_smollm2_answers_through_the_endpoint(base_url):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}
    answers = set()
    for _ in range(4):  # both replicas, most likely
        status, text = _post(f"{base_url}/v1/chat/completions", body)
        assert status == 200, text
        answers.add(json.loads(text)["choices"][0]["message"]["content"])
    assert len(answers) == 1 and "Paris" in answers.pop()


def test_teardown_leaves_no_placement_group_or_actor(sim, base_url):
    from ray import serve

    from ray_train_tpu._compat.ray_llm import TELEMETRY_ACTOR_CLASS

    serve.shutdown()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        live_pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]
        actors = [a for a in alive_actors() if a["class_name"] != TELEMETRY_ACTOR_CLASS]
        if not live_pgs and not actors:
            break
        time.sleep(1)
    assert live_pgs == [] and actors == []
