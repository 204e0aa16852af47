"""The server as a Ray Serve application (issue 18): a local Ray cluster on 127.0.0.1, two engine replicas of
SmolLM2, PostgreSQL as the store, driven by the official `openai` client.

Each session's turns are served by one replica (named in a response header); killing a replica mid-run, its
sessions go on on the other replica with the replies of an uninterrupted run, no turn lost or run twice, and every
session's replay verifies clean.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest
from conftest import PG_URL, bundle_available, pg_store, run_in_threads

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from snapkv_sessions.serve.ray import ATTEMPTS_HEADER, REPLICA_HEADER, RaySpec, build, free_port, start_local  # noqa: E402

MODEL = "smollm2-135m-instruct"
TURNS = ["Name three rivers in Europe.", "Which of them is the longest?", "Say one thing about it."]
POLICY = {"compression": {"budget": 96, "window": 8}, "drift": {"embedder": "none"}}
pytestmark = [pytest.mark.slow, pytest.mark.bundle]


@pytest.fixture(scope="module")
def cluster():
    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    pg_store()  # skips without PostgreSQL
    from ray import serve

    port = free_port()
    start_local(port, num_cpus=2)
    spec = RaySpec(model=MODEL, db=PG_URL, policy=POLICY, replicas=2, sessions_per_replica=4, batch=4,
                   max_tokens=12, api_keys=(KEY_A, KEY_B), torch_threads=1)
    serve.run(build(spec), name="snapkv", route_prefix="/")
    yield f"http://127.0.0.1:{port}/v1"
    serve.shutdown()
    ray.shutdown()


# keys of this run alone: the shared database holds other runs' sessions, which a key scopes away
KEY_A, KEY_B = f"ray-key-a-{uuid.uuid4().hex}", f"ray-key-b-{uuid.uuid4().hex}"


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)


def _conversation(url: str, key: str, i: int, on_turn=None) -> dict:
    """One client's three turns (greedy), each sending the whole conversation; the replies, the session and the
    replica of every turn."""
    client = _client(url, key)
    messages = [{"role": "system", "content": f"You are assistant {i}. Be brief."}]
    out = {"replies": [], "sessions": [], "replicas": [], "attempts": []}
    for t, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8 + i)
        reply = raw.parse()
        out["replies"].append(reply.choices[0].message.content)
        out["sessions"].append(raw.headers["x-session-id"])
        out["replicas"].append(raw.headers[REPLICA_HEADER.lower()])
        out["attempts"].append(int(raw.headers[ATTEMPTS_HEADER.lower()]))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if on_turn is not None:
            on_turn(i, t, out)
    return out


def _run_all(url: str, key: str, on_turn=None) -> dict[int, dict]:
    return run_in_threads(lambda i: _conversation(url, key, i, on_turn), range(4))


def test_sessions_stick_to_a_replica_and_survive_one_dying(cluster):
    from snapkv_sessions import audit
    from snapkv_sessions.models import runner_for

    steady = _run_all(cluster, KEY_A)
    for out in steady.values():
        assert len(set(out["sessions"])) == 1  # one session per conversation
        assert len(set(out["replicas"])) == 1  # served by one replica (affinity)

    killed: list[str] = []
    lock = threading.Lock()

    def kill_during_second_turn(i: int, t: int, out: dict) -> None:
        with lock:
            if t == 0 and not killed:  # the replica of this session dies while its next turn runs there
                killed.append(out["replicas"][0])
                actor = ray.get_actor(out["replicas"][0], namespace="serve")
                threading.Timer(0.3, lambda: ray.kill(actor, no_restart=False)).start()

    failover = _run_all(cluster, KEY_B, kill_during_second_turn)
    assert killed
    assert max(a for out in failover.values() for a in out["attempts"]) > 1  # a request was sent again
    moved = [out for out in failover.values() if killed[0] in out["replicas"]]
    assert moved and any(len(set(out["replicas"])) == 2 for out in moved)  # some session went on elsewhere
    for i in range(4):
        assert failover[i]["replies"] == steady[i]["replies"]  # as if nothing had happened
        assert len(set(failover[i]["sessions"])) == 1

    store = pg_store()
    runner, _ = runner_for(MODEL)
    for out in failover.values():
        sid = out["sessions"][0]
        turns = store.turns(sid)
        assert [t["status"] for t in turns] == ["done"] * 3  # no turn lost, none run twice
        assert [m["role"] for m in store.messages(sid)] == ["system"] + ["user", "assistant"] * 3
        result = audit.verify(store, sid, runner)
        assert result.ok, result.mismatch


def test_the_ingress_answers_errors_like_the_single_process_server(cluster):
    import httpx

    res = httpx.post(f"{cluster}/chat/completions", json={"model": MODEL, "messages": []},
                     headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages"
    res = httpx.get(f"{cluster}/models", timeout=60)
    assert res.status_code == 401
    other = str(uuid.uuid4())
    res = httpx.post(f"{cluster}/chat/completions", headers={"Authorization": f"Bearer {KEY_A}", "X-Session-Id": other},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert res.status_code == 404 and res.json()["error"]["code"] == "session_not_found"
    assert os.environ.get("RAY_USAGE_STATS_ENABLED") == "0"


def test_streamed_turns_through_the_ingress_equal_whole_ones(cluster):
    client = _client(cluster, KEY_A)
    messages = [{"role": "system", "content": f"You are terse ({uuid.uuid4().hex[:6]})."},
                {"role": "user", "content": TURNS[0]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10).choices[0].message.content
    other = _client(cluster, KEY_B)  # another owner: a session of its own
    pieces, usage = [], None
    for chunk in other.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                               stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == whole and usage is not None and usage.completion_tokens > 0


def _by_replica(samples: dict, name: str, **labels: str) -> dict[str, float]:
    """``name``'s samples whose labels include ``labels``, summed per ``replica`` label ("" for the ingress's)."""
    out: dict[str, float] = {}
    for (n, lab), value in samples.items():
        lab = dict(lab)
        if n == name and labels.items() <= lab.items():
            out[lab.get("replica", "")] = out.get(lab.get("replica", ""), 0.0) + value
    return out


def _grown(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much ``name`` grew between two scrapes, over the replicas (and the ingress) of the later one: a replica
    that went away between them is not counted, one that came is counted from 0 (a restarted replica's counters
    start again, as Prometheus reads a reset)."""
    old = _by_replica(before, name, **labels)
    return sum(v - old.get(r, 0.0) for r, v in _by_replica(after, name, **labels).items())


def test_metrics_health_and_ready_through_the_ingress(cluster):
    """The ingress's /health, /ready and /metrics (issue 28): the requests' metrics counted by the ingress, the
    turns' by each engine replica (labelled ``replica``), one exposition; after a known workload the counters grew
    by what the responses say, and no series names a session."""
    import time

    import httpx
    from test_metrics import scrape

    root = cluster.removesuffix("/v1")
    assert httpx.get(f"{root}/health", timeout=30).json() == {"status": "ok"}
    ready = httpx.get(f"{root}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["replicas"] >= 1, ready.text
    before = scrape(httpx.get(f"{root}/metrics", timeout=30).text)
    client = _client(cluster, KEY_B)
    usages = []
    for _ in range(2):
        messages = [{"role": "system", "content": f"You are terse ({uuid.uuid4().hex[:6]})."},
                    {"role": "user", "content": TURNS[0]}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        usages.append(reply.usage)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": TURNS[1]}]
        usage = None
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                    stream_options={"include_usage": True}):
            usage = chunk.usage or usage
        usages.append(usage)
    bad = httpx.post(f"{cluster}/chat/completions", json={"model": MODEL, "messages": []},
                     headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60)
    assert bad.status_code == 400
    deadline = time.monotonic() + 60
    while True:  # each replica pushes its metrics after a turn; the hub may be a moment behind
        text = httpx.get(f"{root}/metrics", timeout=30).text
        after = scrape(text)
        if _grown(before, after, "snapkv:turns_total", replay="false") >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert _grown(before, after, "snapkv:turns_total", replay="false") == 4
    assert _grown(before, after, "vllm:request_success_total") == 4
    assert _grown(before, after, "snapkv:request_errors_total", status="400") == 1
    assert _grown(before, after, "vllm:e2e_request_latency_seconds_count") == 5
    assert _grown(before, after, "vllm:time_to_first_token_seconds_count") == 2  # the streams
    assert _grown(before, after, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert _grown(before, after, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    # the requests' series are the ingress's, the turns' the replicas'
    assert set(_by_replica(after, "vllm:request_success_total")) == {""}
    replicas = set(_by_replica(after, "snapkv:turns_total"))
    assert replicas and "" not in replicas and len(replicas) <= 2
    assert not any("session" in k for _n, labels in after for k, _v in labels)
    assert "vllm:num_requests_running" in {n for n, _lab in after}


def test_the_serve_config_file_builds_the_application():
    import yaml

    from snapkv_sessions.errors import ConfigError

    cfg = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "ray-serve.yaml").read_text())
    app = cfg["applications"][0]
    assert app["import_path"] == "snapkv_sessions.serve.ray:build" and cfg["http_options"]["host"] == "127.0.0.1"
    assert RaySpec.coerce(app["args"]).replicas == 2
    build(app["args"])  # every argument is a RaySpec field; nothing starts
    with pytest.raises(ConfigError, match="replicas"):
        build({**app["args"], "replicas": 0})
    with pytest.raises(ConfigError, match="is not a RaySpec field"):
        build({**app["args"], "replicaz": 2})
    with pytest.raises(ConfigError, match="db"):
        build({"model": MODEL})


def test_serve_ray_refuses_a_public_host_and_a_missing_store():
    from click.testing import CliRunner

    from snapkv_sessions.cli import main

    res = CliRunner().invoke(main, ["serve", "--ray", "--model", MODEL, "--host", "0.0.0.0", "--db", PG_URL,
                                    "--api-key", KEY_A])
    assert res.exit_code != 0 and "binds 127.0.0.1" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["serve", "--ray", "--model", MODEL])
    assert res.exit_code != 0 and "--db" in res.output
