"""Operations (issue 28): ``GET /metrics`` (Prometheus, fed by the stats stream), ``GET /health`` and ``GET /ready``.

In process, on a tiny random model (no bundle): readiness before the app starts, while it runs, when the store does
not answer and while it drains; the sink's counts against what the requests and their turn records say; series
that do not grow with sessions. Against a live server (SmolLM2 bundle, loopback only): a known workload with one
429, scraped and parsed with prometheus_client's own parser; /health while a long turn runs.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import bundle_available, tiny_app
from prometheus_client.parser import text_string_to_metric_families

from snapkv_sessions import stats
from snapkv_sessions.serve.metrics import LABEL_VALUES, OTHER, PrometheusSink

# ---------------------------------------------------------------------- reading a scrape


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (sample name, sorted labels) -> value, as prometheus_client's parser reads it."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items())


# ---------------------------------------------------------------------- in process, a tiny model


def _ask(client, model: str, messages: list[dict], stream: bool = False, max_tokens: int = 3):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return client.post("/v1/chat/completions", json=body)


def _stream_usage(sse: str) -> dict:
    """The usage chunk of a streamed response's SSE text."""
    events = [json.loads(line[5:]) for line in sse.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    return next(e["usage"] for e in events if e.get("usage"))


def test_ready_before_start_while_serving_without_the_store_and_while_draining(tmp_path):
    app, client, service = tiny_app(tmp_path, api_keys=frozenset({"k" * 16}), shutdown_grace_s=30)
    # the app made, its lifespan (worker, sink) not started: alive, not ready
    assert client.get("/health").status_code == 200
    res = client.get("/ready")
    assert res.status_code == 503 and res.json()["reason"] == "starting"
    with client:
        # no key: probes and the scrape answer (Kubernetes sends none); the API does not
        assert client.get("/ready").json() == {"status": "ready", "model": service.model_name}
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401
        real_ping = service.store.ping

        def unreachable() -> None:
            raise ConnectionError("the database went away")

        service.store.ping = unreachable
        res = client.get("/ready")
        assert res.status_code == 503 and res.json()["reason"] == "store_unreachable"
        service.store.ping = real_ping
        assert client.get("/ready").status_code == 200
        app.state.drain()  # what SIGTERM does
        res = client.get("/ready")
        assert res.status_code == 503 and res.json()["reason"] == "draining"
        assert client.get("/health").status_code == 200  # draining is not dead: liveness holds


def test_metrics_behind_the_key_when_asked(tmp_path):
    _app, client, _service = tiny_app(tmp_path, api_keys=frozenset({"k" * 16}), metrics_need_key=True)
    with client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": f"Bearer {'k' * 16}"}).status_code == 200
        assert client.get("/ready").status_code == 200  # probes never need it


def test_counts_equal_the_requests_and_turn_records_and_series_do_not_grow_with_sessions(tmp_path):
    app, client, service = tiny_app(tmp_path)
    model = service.model_name
    words = "the special magic number is hidden within following text".split()
    replies, series_after = [], {}
    with client:
        for i in range(200):
            # 3 to 39 words: some fit the 16-token budget, the longer ones are compressed
            msgs = [{"role": "user", "content": " ".join(words[j % len(words)] for j in range(i % 37 + 3))}]
            res = _ask(client, model, msgs)
            assert res.status_code == 200, res.text
            replies.append(res.json())
            if i + 1 in (10, 200):
                series_after[i + 1] = set(scrape(client.get("/metrics").text))
        # a bad request and a streamed one
        assert _ask(client, model, [{"role": "wizard", "content": "x"}]).status_code == 400
        streamed = _ask(client, model, [{"role": "user", "content": "the magic number"}], stream=True)
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        samples = scrape(client.get("/metrics").text)
    # 200 sessions add no series: the same label sets after 10 sessions and after 200
    assert series_after[10] == series_after[200]
    assert not any("session" in k for _name, labels in series_after[200] for k, _v in labels)
    store = service.store
    turns = [t for r in store.list_sessions() for t in store.turns(r["id"], status="done")]
    assert len(turns) == 201
    assert total(samples, "vllm:request_success_total") == 201
    assert total(samples, "snapkv:request_errors_total", status="400", code="invalid_value") == 1
    assert total(samples, "vllm:prompt_tokens_total") == sum(t["tokens_in"] for t in turns)
    assert total(samples, "vllm:generation_tokens_total") == sum(t["tokens_out"] for t in turns)
    usages = [r["usage"] for r in replies] + [_stream_usage(streamed.text)]
    assert total(samples, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert total(samples, "vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert total(samples, "snapkv:turns_total", replay="false") == 201
    assert total(samples, "vllm:e2e_request_latency_seconds_count") == 202  # every request, the 400 included
    assert total(samples, "vllm:time_to_first_token_seconds_count") == 201
    assert total(samples, "vllm:request_queue_time_seconds_count") == 201  # the 400 never reached the queue
    compressed = sum(t["compression"] is not None for t in turns)
    assert total(samples, "snapkv:compressions_total") == compressed > 0
    layers = service.runner.model.config.num_hidden_layers
    heads = service.runner.model.config.num_key_value_heads
    assert total(samples, "snapkv:kept_share_count") == compressed * layers * heads
    assert total(samples, "vllm:num_requests_running") == total(samples, "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("batch", [0, 2])
def test_compression_safety_signals_equal_the_turn_records(tmp_path, batch):
    """Pinned tokens per role and their retention, kept share per role, kept-set Jaccard, window concentration,
    inter-token latency, hot share, device bytes, recall and the cold-tier pool: each against the turn records of a
    known workload (3 sessions x 3 turns, tiered with decode-time recall, a system message pinned), run through the
    server's own runner (with ``batch``, its scheduler) while the app runs, and scraped from its ``/metrics``.

    The sessions are driven through the Python API in the server's process (the sink sees every stat of the
    process): the tiny model's word tokenizer does not render its own replies back to the same tokens, so an HTTP
    client could not continue them (the live-server test below continues sessions over HTTP on a real model)."""
    from snapkv_sessions import Session
    from snapkv_sessions.tierpool import POOL

    policy = {"compression": {"budget": 16, "window": 4}, "drift": {"embedder": "none"},
              # every recalling step escalates (taken again over the whole history): the counters must say so
              "memory": {"cold": True, "recall": {"budget": 2, "selector": "exact", "escalate": 1e9}}}
    _app, client, service = tiny_app(tmp_path, policy=policy, batch=batch)
    words = "the special magic number is hidden within following text of many words".split()
    with client:
        live = []  # held to the end: the pool's tiers are the live sessions'
        for i in range(3):
            session = Session.create_on(service.runner, service.model_id, service.policy, service.store,
                                        {"system": f"rule {i}: answer with numbers only"})
            for t in range(3):
                session.chat(" ".join(words[(i + t + j) % len(words)] for j in range(9)), max_new_tokens=2)
            live.append(session)
        samples = scrape(client.get("/metrics").text)
    store = service.store
    sessions = [[t for t in store.turns(r["id"], status="done")] for r in store.list_sessions()]
    assert [len(turns) for turns in sessions] == [3, 3, 3]  # every turn continued its session
    turns = [t for turns in sessions for t in turns]
    compressed = [t for t in turns if t["compression"] is not None]
    assert len(compressed) == len(turns)  # the 16-token budget is below every turn's context
    # pins: every pinned position of every compressed turn counted once, by role, and none evicted
    pinned = sum(t["compression"]["pinned_total"] for t in compressed)
    assert total(samples, "snapkv:pinned_tokens_total") == pinned > 0
    assert total(samples, "snapkv:pinned_tokens_total", role="system") > 0
    assert total(samples, "snapkv:pinned_tokens_evicted_total") == 0
    assert all(t["compression"]["pinned_kept"] == t["compression"]["pinned_total"] for t in compressed)
    assert total(samples, "snapkv:pinned_retention_bucket", le="0.99") == 0  # retention 1.0 every time
    # kept share per role: one observation per compressed turn and role, summing to the records' shares
    assert total(samples, "snapkv:kept_share_by_role_count") == sum(len(t["kept_per_role"]) for t in compressed)
    assert total(samples, "snapkv:kept_share_by_role_sum") == pytest.approx(
        sum(v for t in compressed for v in t["kept_per_role"].values()))
    assert total(samples, "snapkv:kept_share_by_role_sum", role="system") == pytest.approx(
        sum(t["kept_per_role"]["system"] for t in compressed))
    # kept-set Jaccard: a compressed turn whose previous turn was compressed too
    pairs = sum(b["compression"] is not None and a["compression"] is not None
                for turns in sessions for a, b in zip(turns, turns[1:], strict=False))
    assert total(samples, "snapkv:kept_jaccard_count") == pairs > 0
    # the window's concentration: once per compression
    assert total(samples, "snapkv:window_top_mass_count") == len(compressed)
    assert total(samples, "snapkv:window_entropy_count") == len(compressed)
    # inter-token latency: one gap per decode step, and a turn's decode steps are its tokens fed into the cache
    assert total(samples, "vllm:inter_token_latency_seconds_count") == sum(len(t["decode_tokens"]) for t in turns)
    # memory: hot share and device bytes once per live turn; recall as the records say
    assert total(samples, "snapkv:turn_hot_share_count") == len(turns)
    recalling = [t["compression"]["tier"]["recall"] for t in compressed if t["compression"]["tier"].get("recall")]
    assert recalling and total(samples, "snapkv:recall_repeat_rate_count") == len(recalling)
    steps = sum(r["steps"] for r in recalling)
    assert total(samples, "snapkv:recall_steps_total") == steps > 0
    assert total(samples, "snapkv:recall_escalated_steps_total") == sum(r["escalated"] for r in recalling) == steps
    assert total(samples, "snapkv:turn_device_bytes_sum") == sum(
        t["compression"]["tier"]["hot_bytes"] + (t["compression"]["tier"].get("recall") or {}).get("summary_bytes", 0)
        for t in compressed)
    # the pool's gauge: what the process's cold tiers hold now
    assert total(samples, "snapkv:tier_pool_bytes") == POOL.nbytes > 0
    assert total(samples, "snapkv:tier_pool_tiers", where="host") >= 3


def _stats(**fields):
    base = {"session_id": "s", "turn": 1, "model": "m", "decision": "kept", "reprefill_reason": None,
            "prompt_tokens": 3, "prefilled_tokens": 3, "decoded_tokens": 2, "context_tokens": 5, "hot_tokens": (5,),
            "prefill_s": 0.5, "decode_s": 0.1, "compression_s": 0.05, "recalled_slots": 0, "hot_bytes": 1024,
            "cold_bytes": 0, "replay": False}
    return stats.TurnStat(**{**base, **fields})


def test_the_sink_bounds_every_label_and_reads_reprefill_causes():
    sink = PrometheusSink("m")
    for i in range(3 * LABEL_VALUES):  # a kind per emit: past the cap they count as "other", never a new series
        sink.record(stats.FaultStat(f"kind-{i}", f"session-{i}", "x"))
    sink.record(_stats(decision="reprefill", reprefill_reason="tier lost: evicted by the cold tier's byte cap"))
    sink.record(_stats(decision="reprefill", reprefill_reason=stats.REPREFILL_DRIFT))
    sink.record(_stats(decision="reprefill", reprefill_reason="something new", replay=True))
    sink.record(stats.TierEvent("lost", None, 4096, 12, "memory_limit"))
    from prometheus_client import generate_latest

    samples = scrape(generate_latest(sink.registry).decode())
    faults = {dict(lab)["kind"] for (name, lab) in samples if name == "snapkv:faults_total"}
    assert len(faults) == LABEL_VALUES + 1 and OTHER in faults
    assert total(samples, "snapkv:faults_total") == 3 * LABEL_VALUES
    assert total(samples, "snapkv:faults_total", kind=OTHER) == 2 * LABEL_VALUES
    assert total(samples, "snapkv:reprefills_total", cause="tier_lost") == 1
    assert total(samples, "snapkv:reprefills_total", cause="drift") == 1
    assert total(samples, "snapkv:reprefills_total") == 2  # the replayed one is no live re-prefill
    assert total(samples, "snapkv:turns_total", decision="reprefill", replay="true") == 1
    assert total(samples, "snapkv:tier_events_total", kind="lost", reason="memory_limit") == 1
    assert total(samples, "snapkv:tier_bytes_total", kind="lost") == 4096
    assert [stats.reprefill_cause(r) for r in (None, "drift", "tier lost: x", "as recorded", "new")] == [
        None, "drift", "tier_lost", "as_recorded", "other"]


# ---------------------------------------------------------------------- a live server


@pytest.mark.slow
@pytest.mark.bundle
def test_a_known_workload_with_one_429_scraped_from_a_live_server(tmp_path):
    """3 sessions x 2 turns (plain and streamed), one long stream with a request queued behind it and one refused
    with 429 (a queue of one, one turn at a time). The scrape's counters and histogram counts equal the responses
    and the turn records; /health and /ready answer while the long turn runs; no key is needed for them."""
    pytest.importorskip("openai")
    from test_serve import KEY_A, MODEL, Server

    from snapkv_sessions.store import SessionStore

    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    srv = Server(tmp_path, "--api-key", KEY_A, "--max-queue", "1", "--batch", "1")
    root = srv.url.removesuffix("/v1")
    usages, statuses = [], []
    try:
        for s in range(3):
            msgs = [{"role": "system", "content": f"You are assistant {s}. Be brief."}]
            for t, question in enumerate(("Name a colour.", "And another?")):
                msgs.append({"role": "user", "content": question})
                res = srv.client().chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=bool(t),
                    **({"stream_options": {"include_usage": True}} if t else {}))
                if t:
                    chunks = list(res)
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    usage = next(c.usage for c in chunks if c.usage is not None)
                else:
                    text, usage = res.choices[0].message.content, res.usage
                usages.append(usage)
                msgs.append({"role": "assistant", "content": text})
        streaming, long_out = threading.Event(), {}

        def long_stream() -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                    "max_tokens": 120, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{srv.url}/chat/completions", json=body, headers=srv.auth(KEY_A),
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and '"content"' in line:
                        streaming.set()
                    if line.startswith("data:") and '"usage"' in line:
                        long_out["usage"] = json.loads(line[5:])["usage"]

        def queued() -> None:
            res = srv.post("/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "Hi."}]})
            long_out["queued"] = res

        first = threading.Thread(target=long_stream)
        first.start()
        assert streaming.wait(60)
        t0 = time.perf_counter()
        health = httpx.get(f"{root}/health", timeout=10)
        assert health.status_code == 200 and time.perf_counter() - t0 < 2.0  # the long turn does not hold it
        assert httpx.get(f"{root}/ready", timeout=10).status_code == 200
        second = threading.Thread(target=queued)
        second.start()
        time.sleep(0.5)  # the second request now waits in the queue
        busy = srv.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hey."}]})
        statuses.append(busy.status_code)
        first.join(120)
        second.join(120)
        assert long_out["queued"].status_code == 200
        usages += [long_out["usage"], long_out["queued"].json()["usage"]]
        res = httpx.get(f"{root}/metrics", timeout=10)  # no key: open, as vLLM's
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
        samples = scrape(res.text)
    finally:
        srv.stop()
    assert statuses == [429]

    def usage(u, field: str) -> int:
        return u[field] if isinstance(u, dict) else getattr(u, field)

    store = SessionStore(f"sqlite:///{srv.db}")
    turns = [t for r in store.list_sessions() for t in store.turns(r["id"], status="done")]
    assert len(turns) == len(usages) == 8
    prompt = sum(usage(u, "prompt_tokens") for u in usages)
    generated = sum(usage(u, "completion_tokens") for u in usages)
    assert total(samples, "vllm:prompt_tokens_total") == prompt == sum(t["tokens_in"] for t in turns)
    assert total(samples, "vllm:generation_tokens_total") == generated == sum(t["tokens_out"] for t in turns)
    assert total(samples, "vllm:request_success_total") == 8
    assert total(samples, "snapkv:request_errors_total") == 1
    assert total(samples, "snapkv:request_errors_total", status="429", code="queue_full") == 1
    assert total(samples, "snapkv:requests_stopped_total") == 0
    assert total(samples, "vllm:e2e_request_latency_seconds_count") == 9
    assert total(samples, "vllm:time_to_first_token_seconds_count") == 8
    assert total(samples, "vllm:request_queue_time_seconds_count") == 8
    assert total(samples, "vllm:request_time_per_output_token_seconds_count") == sum(
        usage(u, "completion_tokens") > 1 for u in usages)
    assert total(samples, "snapkv:turns_total", replay="false") == 8  # the warm start is not counted
    assert total(samples, "vllm:request_prefill_time_seconds_count") == 8
    assert total(samples, "snapkv:decode_steps_total") == total(samples, "snapkv:decode_batch_size_count") > 0
    assert total(samples, "snapkv:batch_slots") == 1
    assert total(samples, "vllm:num_requests_running") == total(samples, "vllm:num_requests_waiting") == 0
    assert {dict(lab).get("model_name") for (_n, lab) in samples} == {MODEL}


def test_a_job_says_why_it_stops():
    from snapkv_sessions.serve.worker import Job

    job = Job(lambda _job: None, time.monotonic() + 60)
    assert job.stop_cause() is None and not job.should_stop()
    job.cancelled.set()
    assert job.stop_cause() == "client_left"
    job.shutdown.set()  # the server stopping outranks the client: the client is told 503
    assert job.stop_cause() == "shutdown" and type(job.stopped()).__name__ == "ShuttingDown"
    late = Job(lambda _job: None, time.monotonic() - 1)
    assert late.stop_cause() == "deadline" and type(late.stopped()).__name__ == "DeadlineExceeded"


def test_a_turn_stopped_by_its_deadline_is_counted_by_cause(tmp_path):
    _app, client, service = tiny_app(tmp_path, request_timeout_s=0.3)
    with client:
        res = _ask(client, service.model_name, [{"role": "user", "content": "the magic number"}], max_tokens=1900)
        samples = scrape(client.get("/metrics").text)
    assert res.status_code == 504 and res.json()["error"]["code"] == "deadline_exceeded", res.text
    assert total(samples, "snapkv:request_errors_total", status="504", code="deadline_exceeded") == 1
    assert total(samples, "snapkv:requests_stopped_total", cause="deadline") == 1
    assert total(samples, "vllm:request_queue_time_seconds_count") == 1  # it had started
    assert [t["status"] for r in service.store.list_sessions() for t in service.store.turns(r["id"])] == ["abandoned"]


@pytest.mark.slow
@pytest.mark.bundle
def test_a_reprefill_and_an_abandoned_stream_scraped_from_a_live_server(tmp_path):
    """A live server whose cold-tier pool holds 1 byte: a session's first turn is compressed and its tier dropped
    by the pool, so its second turn re-prefills (cause tier_lost); a stream left after its first piece is
    abandoned (499, stopped by client_left). The scrape equals the turn records and the responses."""
    pytest.importorskip("openai")
    from test_serve import KEY_A, MODEL, POLICY, Server

    from snapkv_sessions.store import SessionStore

    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    policy = {**POLICY, "memory": {"cold": True, "max_bytes": 1}}
    srv = Server(tmp_path, "--api-key", KEY_A, policy=policy)
    root = srv.url.removesuffix("/v1")
    store = SessionStore(f"sqlite:///{srv.db}")
    try:
        doc = " ".join(f"Shelf {i} holds {i * 7 % 13} crates of item {i}." for i in range(60))  # > the 256 budget
        msgs = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": f"{doc}\nWhat does shelf 3 hold?"}]
        usages = []
        for question in (None, "And shelf 4?"):
            if question:
                msgs.append({"role": "user", "content": question})
            res = srv.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
            usages.append(res.usage)
            msgs.append({"role": "assistant", "content": res.choices[0].message.content})
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story about a fox."}],
                "max_tokens": 60, "stream": True}
        with httpx.stream("POST", f"{srv.url}/chat/completions", json=body, headers=srv.auth(KEY_A),
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    break  # leave after the first piece: the connection closes with the block
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the server notices at its next write
            abandoned = [t for row in store.list_sessions() for t in store.turns(row["id"], status="abandoned")]
            samples = scrape(httpx.get(f"{root}/metrics", timeout=10).text)
            if abandoned and total(samples, "snapkv:request_errors_total", status="499") == 1:
                break
            time.sleep(0.5)
    finally:
        srv.stop()
    turns = [t for row in store.list_sessions() for t in store.turns(row["id"], status="done")]
    assert len(turns) == 2 and len(abandoned) == 1
    assert [t["drift_decision"] for t in turns] == ["n/a", "reprefill"]  # a first turn decides nothing
    assert total(samples, "snapkv:reprefills_total", cause="tier_lost") == 1 == total(samples, "snapkv:reprefills_total")
    assert total(samples, "snapkv:tier_events_total", kind="lost", reason="memory_limit") >= 1
    assert total(samples, "snapkv:request_errors_total", status="499", code="client_disconnected") == 1
    assert total(samples, "snapkv:requests_stopped_total", cause="client_left") == 1
    assert total(samples, "vllm:request_success_total") == 2
    # an abandoned turn is no finished turn: its tokens are not counted (the request is, as a 499)
    assert total(samples, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages) == sum(
        t["tokens_in"] for t in turns)
    # the re-prefill ran the whole history through the model again: its plan holds the first turn's tokens too
    assert turns[1]["tokens_in"] > turns[0]["tokens_in"]
    assert total(samples, "snapkv:prefilled_tokens_total", replay="false") == sum(t["tokens_in"] for t in turns)
    # the pins held: the system message and the sinks, every compressed turn
    compressed = [t for t in turns if t["compression"] is not None]
    assert compressed and total(samples, "snapkv:pinned_tokens_total") == sum(
        t["compression"]["pinned_total"] for t in compressed)
    assert total(samples, "snapkv:pinned_tokens_evicted_total") == 0
    # every done turn's decode steps gave a gap (the abandoned stream's steps too, before it stopped)
    assert total(samples, "vllm:inter_token_latency_seconds_count") >= sum(len(t["decode_tokens"]) for t in turns)


def test_one_exposition_of_the_ingress_and_its_replicas():
    """The Ray ingress's /metrics (serve/metrics.exposition): its own registry and each replica's scrape text, each
    family once (one HELP and TYPE), every replica's samples labelled with its name, nothing lost or summed."""
    from prometheus_client import generate_latest

    from snapkv_sessions.serve.metrics import REPLICA_LABEL, exposition

    ingress, replicas = PrometheusSink("m", batch_slots=None), {"r1": PrometheusSink("m", 4), "r2": PrometheusSink("m", 4)}
    ingress.record(stats.RequestStat(200, "ok", None, False, "stop", 0.1, 0.2, 0.1, 0.5, 3, 4))
    for n, sink in enumerate(replicas.values(), start=1):
        for _ in range(n):
            sink.record(_stats(decoded_tokens=5))
            sink.record(stats.DecodeStepStat(1, 1, 0.05, 1024, (0.05,)))
    text = exposition(ingress.registry, {r: generate_latest(s.registry).decode() for r, s in replicas.items()}).decode()
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # each family once
    samples = scrape(text)
    assert total(samples, "vllm:request_success_total") == 1
    assert {dict(lab).get(REPLICA_LABEL) for (n, lab) in samples if n == "vllm:request_success_total"} == {None}
    for name, want in (("vllm:generation_tokens_total", (5, 10)), ("snapkv:decode_steps_total", (1, 2)),
                       ("vllm:inter_token_latency_seconds_count", (1, 2)), ("snapkv:batch_slots", (4, 4))):
        assert (total(samples, name, replica="r1"), total(samples, name, replica="r2")) == want, name
    assert not any(n == "snapkv:batch_slots" and REPLICA_LABEL not in dict(lab) for (n, lab) in samples)


def test_no_metrics_keeps_no_sink_and_answers_404(tmp_path):
    _app, client, service = tiny_app(tmp_path, metrics=False)
    with client:
        res = _ask(client, service.model_name, [{"role": "user", "content": "the magic number"}])
        assert res.status_code == 200
        off = client.get("/metrics")
        assert off.status_code == 404 and off.json()["error"]["code"] == "metrics_off"
        assert not any(isinstance(s, PrometheusSink) for s in stats.registered())


def test_top_reads_a_servers_metrics(tmp_path):
    """``snapkv-sessions top --once --json`` against a loopback HTTP server answering a sink's scrape: the figures
    are the scrape's (gauges and totals as they stand, quantiles from what the window observed)."""
    import http.server

    from click.testing import CliRunner
    from prometheus_client import generate_latest

    from snapkv_sessions.cli import main

    sink = PrometheusSink("m", batch_slots=2)
    sink.record(stats.QueueStat(running=2, waiting=1))
    sink.record(stats.PoolStat(host_bytes=3 << 20, cap_bytes=1 << 30, tiers=2, spilled=0))
    served = {"n": 0}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            served["n"] += 1
            if served["n"] == 2:  # between the two scrapes: 4 requests answered, TTFT 0.3 s each
                for _ in range(4):
                    sink.record(stats.RequestStat(200, "ok", None, True, "stop", 0.0, 0.3, 0.2, 0.5, 3, 4))
            body = generate_latest(sink.registry)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = CliRunner().invoke(main, ["top", "--url", url, "--once", "--json", "--interval", "0.2"])
        assert res.exit_code == 0, res.output
        got = json.loads(res.output)
        assert got["requests running"] == 2 and got["requests waiting"] == 1
        assert got["cold-tier pool bytes"] == 3 << 20 and got["pinned tokens evicted (must be 0)"] is None
        assert 0.25 < got["TTFT p50"] <= 0.5  # the 0.3 s observations, in the (0.25, 0.5] bucket
        assert got["requests answered /s"] > 0
        plain = CliRunner().invoke(main, ["top", "--url", url, "--once", "--interval", "0.2"])
        assert plain.exit_code == 0 and "requests running" in plain.output and "3.0 MiB" in plain.output
        bad = CliRunner().invoke(main, ["top", "--url", "ftp://x", "--once"])
        assert bad.exit_code != 0 and "--url" in bad.output
    finally:
        server.shutdown()


def test_a_reply_holding_a_special_token_makes_the_next_turn_re_prefill_not_fail(tmp_path):
    """The tiny model decodes its tokenizer's ``<eos>`` (not the model's end token) mid-reply: the stored reply
    leaves it out, so the conversation no longer renders to the cached tokens. The next turn re-prefills from the
    store (cause ``render``) instead of refusing every later turn of the session."""
    from snapkv_sessions import Session

    policy = {"compression": {"budget": 16, "window": 4}, "drift": {"embedder": "none"},
              "memory": {"cold": True, "recall": {"budget": 2, "selector": "exact"}}}
    _app, client, service = tiny_app(tmp_path, policy=policy)
    words = "the special magic number is hidden within following text of many words".split()
    eos = service.runner.tokenizer.convert_tokens_to_ids("<eos>")
    with client:
        turns = []
        for i in range(3):
            session = Session.create_on(service.runner, service.model_id, service.policy, service.store,
                                        {"system": f"rule {i}: answer with numbers only"})
            for t in range(3):
                session.chat(" ".join(words[(i + t + j) % len(words)] for j in range(9)), max_new_tokens=4)
            turns.append(service.store.turns(session.id, status="done"))
        samples = scrape(client.get("/metrics").text)
    assert [len(ts) for ts in turns] == [3, 3, 3]  # no turn refused
    after = [b for ts in turns for a, b in zip(ts, ts[1:], strict=False)
             if eos in a["decode_tokens"] + a["pending_tokens"]]
    assert after and all(b["drift_decision"] == "reprefill" for b in after)
    assert total(samples, "snapkv:reprefills_total", cause="render") == len(after)
