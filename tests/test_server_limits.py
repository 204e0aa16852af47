"""Server hardening (issue 29), against a live server (uvicorn subprocess, SmolLM2 bundle, SQLite or PostgreSQL):
one client's bad parameter never touches another's turn, a request is bounded and admitted whole before anything
is stored, bad input is a 4xx naming the field with nothing stored, SIGTERM stops turns cleanly, and the small
faults a probe found. The store failing midway is shown in process (the store is made to fail), so is the pool.

Everything binds to and talks to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from conftest import PG_URL, bundle_available, run_in_threads

pytest.importorskip("openai")

from test_serve import KEY_A, MODEL, Server  # noqa: E402

from snapkv_sessions.store import SessionStore  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.bundle]
STORY = [{"role": "system", "content": "You are a storyteller."},
         {"role": "user", "content": "Write a long story about a river and a boat."}]


def _need_bundle() -> None:
    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    _need_bundle()
    server = Server(tmp_path_factory.mktemp("limits"), "--api-key", KEY_A, "--batch", "4", "--docs",
                    "--max-messages", "1024")
    yield server
    assert server.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in (server.db.parent / "serve.log").read_text()


def _stored(server: Server, ignore_story: bool = False) -> tuple[int, int, int]:
    """(sessions, messages, turns) in the server's store, read by another process as an operator would;
    ``ignore_story``: leave out the sessions of the victims' requests running meanwhile."""
    store = SessionStore(f"sqlite:///{server.db}")
    rows = [r for r in store.list_sessions()
            if not (ignore_story and [m["content"] for m in store.messages(r["id"])[:1]] == [STORY[0]["content"]])]
    return len(rows), sum(len(store.messages(r["id"])) for r in rows), sum(len(store.turns(r["id"])) for r in rows)


def _chat(server: Server, body: dict, headers: dict | None = None) -> httpx.Response:
    return server.post("/chat/completions", {"model": MODEL, **body}, headers=headers)


def _stream_text(server: Server, body: dict, started: threading.Event | None = None) -> tuple[str, list[dict]]:
    """A streamed request's text and its events (error events included)."""
    events, text = [], []
    payload = {"model": MODEL, **body, "stream": True}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=payload, headers=server.auth(KEY_A),
                      timeout=120) as res:
        assert res.status_code == 200, res.read()
        for line in res.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            events.append(event)
            piece = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if piece:
                text.append(piece)
                if started is not None:
                    started.set()
    return "".join(text), events


# ---------------------------------------------------------------------- 1. one client's bad sampling parameter


@pytest.mark.parametrize("bad", [{"temperature": 1e-300}, {"temperature": 1e-40},
                                 {"temperature": 1.0, "top_p": 1e-300, "seed": 3}])
def test_a_bad_sampling_value_never_fails_another_clients_turn(srv, bad):
    alone, _ = _stream_text(srv, {"messages": STORY, "max_tokens": 48})
    assert len(alone) > 40  # long enough to be decoding while the other request runs
    started, results = threading.Event(), {}

    def victim() -> None:
        results["victim"] = _stream_text(srv, {"messages": STORY, "max_tokens": 48}, started)[0]

    thread = threading.Thread(target=victim)
    thread.start()
    assert started.wait(60)
    res = _chat(srv, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **bad})
    thread.join(120)
    assert res.status_code == 200, res.text  # numerically safe: a vanishing temperature or top_p is greedy
    assert results["victim"] == alone  # decoded beside the bad one, the victim's reply is its reply alone
    greedy = _chat(srv, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert res.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------- 2 and 4. bounded, admitted whole


def test_a_huge_request_is_refused_at_once_and_stores_nothing(srv):
    first = _chat(srv, {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2})
    assert first.status_code == 200
    earlier = [{"role": "user", "content": "Hi."}, {"role": "assistant",
                                                    "content": first.json()["choices"][0]["message"]["content"]}]
    before = _stored(srv)
    tiny = [{"role": "user" if i % 2 else "assistant", "content": "x"} for i in range(40_001)]
    t0 = time.perf_counter()
    res = _chat(srv, {"messages": earlier + tiny[1:], "max_tokens": 2})  # continues the session by content hash
    assert time.perf_counter() - t0 < 1.0
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages", res.text
    assert "at most 1024 messages" in res.json()["error"]["message"]
    assert _stored(srv) == before


def test_rendered_tokens_decide_admission_before_anything_is_stored(srv):
    """1,001 short messages: their content fits SmolLM2's 8,192 positions, their rendering (role markers and
    separators around each) does not. Refused whole, quickly, with nothing stored; a reply cap that overflows
    the context is refused the same way, naming max_tokens."""
    before = _stored(srv)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "one two three"} for i in range(1001)]
    t0 = time.perf_counter()
    res = _chat(srv, {"messages": msgs, "max_tokens": 2})
    assert time.perf_counter() - t0 < 1.0
    assert res.status_code == 400 and res.json()["error"]["param"] == "model.max_position_embeddings", res.text
    assert 3 * 1001 < 8192 < int(res.json()["error"]["message"].split("would hold ")[1].split()[0])
    res = _chat(srv, {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8190})
    assert res.status_code == 400 and res.json()["error"]["param"] == "max_tokens", res.text
    streamed = srv.post("/chat/completions", {"model": MODEL, "messages": msgs, "stream": True})
    assert streamed.status_code == 400  # a stream refused by admission keeps its status (not 200 + an event)
    assert _stored(srv) == before


# ---------------------------------------------------------------------- 5. 500s from input


def _deep(depth: int) -> str:
    """A marker for JSON nested ``depth`` deep, spelled out in the body's text (no encoder recurses that deep)."""
    return f"<deep {depth}>"


def _raw(body: dict) -> bytes:
    text = json.dumps(body)
    for depth in (5000, 70):
        text = text.replace(json.dumps(_deep(depth)), "[" * depth + '"x"' + "]" * depth)
    return text.encode()


@pytest.mark.parametrize(("body", "param"), [
    ({"metadata": {"a": _deep(5000)}}, "body"),
    ({"metadata": {"a": _deep(70)}}, "body"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(5000)}}]}, "body"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**31}, "seed"),  # past the turns table's INTEGER column on PostgreSQL
    ({"seed": -1}, "seed"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"stop": ["x" * 300]}, "stop"),
])
def test_bad_input_is_a_400_naming_the_field_and_stores_nothing(srv, body, param):
    before = _stored(srv)
    raw = _raw({"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, **body})
    res = httpx.post(f"{srv.url}/chat/completions", content=raw, timeout=60,
                     headers={**srv.auth(KEY_A), "Content-Type": "application/json"})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param
    assert len(res.text) < 2000
    assert _stored(srv) == before


def test_deep_tool_call_arguments_are_refused_before_anything_is_stored(srv):
    before = _stored(srv)
    args = "[" * 5000 + "]" * 5000
    msgs = [{"role": "user", "content": "Call it."},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    res = _chat(srv, {"messages": msgs, "max_tokens": 2})
    assert res.status_code == 400 and res.json()["error"]["param"] == "messages[1].tool_calls.function.arguments"
    assert _stored(srv) == before


# ---------------------------------------------------------------------- 7. the smaller faults


def test_small_faults(srv):
    before = _stored(srv)
    hi = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    res = _chat(srv, hi, headers={"X-Session-Id": ""})
    assert res.status_code == 400 and res.json()["error"]["param"] == "session_id"
    long_id = "a" * 10_000
    res = srv.get(f"/sessions/{long_id}")
    assert res.status_code == 404 and len(res.text) < 500
    for path in (f"/sessions/{'%00'}", "/sessions/..%2F..%2Fetc"):
        assert srv.get(path).status_code == 404
    res = httpx.get(f"{srv.url}/no-such-route", headers=srv.auth(KEY_A))
    assert res.status_code == 404 and res.json()["error"]["code"] == "unknown_route"
    res = httpx.put(f"{srv.url}/chat/completions", headers=srv.auth(KEY_A))
    assert res.status_code == 405 and res.json()["error"]["type"] == "invalid_request_error"
    root = srv.url.removesuffix("/v1")
    for page in ("/docs", "/redoc", "/openapi.json"):  # asked for (--docs), and behind the key
        assert httpx.get(root + page).status_code == 401
        assert httpx.get(root + page, headers=srv.auth(KEY_A)).status_code == 200
    assert _stored(srv) == before


def test_a_session_deleted_mid_turn_ends_its_stream_saying_so(srv):
    started, out = threading.Event(), {}

    def stream() -> None:
        out["text"], out["events"] = _stream_text(srv, {"messages": STORY, "max_tokens": 200}, started)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    store = SessionStore(f"sqlite:///{srv.db}")
    newest = max(store.list_sessions(), key=lambda r: r["created_at"])
    store.delete_session(newest["id"])  # as `snapkv-sessions sessions delete` does, from another process
    thread.join(120)
    error = out["events"][-1].get("error")
    assert error is not None and "was deleted" in error["message"], out["events"][-1]
    assert "Error" not in error["message"]  # no store exception class named
    assert not store.session_exists(newest["id"])


# ---------------------------------------------------------------------- 6. SIGTERM mid-turn


def test_sigterm_mid_turn_is_503_and_a_final_event_and_nothing_pending(tmp_path):
    _need_bundle()
    server = Server(tmp_path, "--api-key", KEY_A, "--batch", "2", "--shutdown-grace", "1")
    results: dict = {}
    started = threading.Event()
    try:
        assert httpx.get(server.url.removesuffix("/v1") + "/docs").status_code == 404  # off unless asked

        def plain() -> None:
            results["plain"] = _chat(server, {"messages": STORY, "max_tokens": 2000})

        def streamed() -> None:
            results["stream"] = _stream_text(server, {"messages": STORY[1:], "max_tokens": 2000}, started)

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        code = server.proc.wait(60)
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert code in (0, -signal.SIGTERM)
    plain = results["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert int(plain.headers["Retry-After"]) >= 1
    last = results["stream"][1][-1]
    assert last["error"]["code"] == "shutting_down"
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "SIGTERM: draining (2 running" in log and log.rstrip().endswith("stopped")  # the server says what it does
    assert " POST /v1/chat/completions 503 " in log and " GET /docs 404 " in log  # one line per request
    store = SessionStore(f"sqlite:///{server.db}")
    for row in store.list_sessions():
        assert [t["status"] for t in store.turns(row["id"])] == ["abandoned"]
        assert store.verify(row["id"]) == []


# ---------------------------------------------------------------------- 3. PostgreSQL: connections per turn


@pytest.mark.service
def test_sixteen_turns_at_once_on_postgresql(tmp_path):
    _need_bundle()
    from conftest import pg_store

    pg_store()  # skips when PostgreSQL is not reachable
    server = Server(tmp_path, "--api-key", KEY_A, "--batch", "16", "--db", PG_URL)
    try:
        def one(i: int) -> int:
            res = _chat(server, {"messages": [{"role": "user", "content": f"Count to {i}. ({time.time()})"}],
                                 "max_tokens": 6})
            return res.status_code

        codes = run_in_threads(one, range(16), 300)
        assert sorted(codes.values()) == [200] * 16
        assert server.get("/sessions/%00").status_code == 404  # a NUL never reaches PostgreSQL
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "QueuePool" not in log


# ---------------------------------------------------------------------- the HTTP fuzz suite

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=30), st.sampled_from(["", "\x00", "\ud800"[:0] + "\u202e", "💥" * 5, "user"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=20)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "document", "evil", ""])
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": ROLES, "content": st.one_of(st.text(max_size=40), JSON)},
                          optional={"name": JSON, "tool_call_id": JSON, "tool_calls": JSON, "extra": JSON}),
    JSON)
FIELDS = {
    "model": st.one_of(st.just(MODEL), JSON),
    "messages": st.one_of(st.lists(MESSAGE, min_size=0, max_size=4), JSON),
    "max_tokens": st.one_of(st.integers(-3, 6), st.just(10**20), JSON),
    "temperature": st.one_of(st.floats(-1, 3), st.just(1e-300), JSON),
    "top_p": st.one_of(st.floats(-1, 2), st.just(1e-300), JSON),
    "seed": st.one_of(st.integers(-(2**64), 2**64), JSON),
    "stop": JSON, "stream": JSON, "n": JSON, "metadata": JSON, "tools": JSON, "tool_choice": JSON,
    "stream_options": JSON, "logprobs": JSON, "presence_penalty": JSON, "whatever": JSON,
}
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(min_size=1, max_size=30)}), max_size=3).map(
    lambda msgs: [*msgs, {"role": "user", "content": "Say one word."}])
NEAR_VALID = st.fixed_dictionaries(  # mostly accepted: the turn runs, decoding beside the victims
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 4), "messages": VALID_MESSAGES},
    optional={"temperature": st.one_of(st.floats(0, 2), st.just(1e-300), st.just(2.5)),
              "top_p": st.one_of(st.floats(1e-300, 1), st.just(0.0)), "seed": st.integers(-5, 2**64),
              "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5)),
              "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
              "stream": st.booleans()})
BODY = st.one_of(NEAR_VALID, NEAR_VALID,
                 st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 4),
                                        "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                       optional={k: v for k, v in FIELDS.items()
                                                 if k not in ("model", "messages", "max_tokens")}),
                 st.dictionaries(st.sampled_from(sorted(FIELDS)), JSON, max_size=6), JSON)
FUZZ_CASES: list[int] = []


@pytest.fixture
def victims(srv):
    """Valid streamed requests, one after another in a thread, decoding beside whatever the test sends; at the
    end every one of their replies must equal the same request alone."""
    alone, _ = _stream_text(srv, {"messages": STORY, "max_tokens": 24})
    stop, replies = threading.Event(), []

    def loop() -> None:
        while not stop.is_set():
            replies.append(_stream_text(srv, {"messages": STORY, "max_tokens": 24})[0])

    thread = threading.Thread(target=loop)
    thread.start()
    yield
    stop.set()
    thread.join(120)
    assert len(replies) >= 2 and all(r == alone for r in replies), replies
    print(f"fuzz: {len(FUZZ_CASES)} bodies, {sum(c < 300 for c in FUZZ_CASES)} answered 2xx, "
          f"{sum(400 <= c < 500 for c in FUZZ_CASES)} 4xx; {len(replies)} valid replies beside them, all equal alone")


@settings(max_examples=200, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=BODY)
def test_fuzzed_bodies_get_2xx_or_4xx_store_nothing_on_4xx_and_never_change_other_replies(srv, victims, body):
    before = _stored(srv, ignore_story=True)
    raw = json.dumps(body, allow_nan=True).encode()
    res = httpx.post(f"{srv.url}/chat/completions", content=raw, timeout=120,
                     headers={**srv.auth(KEY_A), "Content-Type": "application/json"})
    FUZZ_CASES.append(res.status_code)
    assert res.status_code < 500, (body, res.text)
    if res.status_code >= 400:
        assert res.json()["error"]["type"] in ("invalid_request_error", "rate_limit_error")
        if res.status_code != 429:
            assert _stored(srv, ignore_story=True) == before, (body, res.text)


# ---------------------------------------------------------------------- in process: the store failing


def _app(smollm2, store: SessionStore, **options):
    from fastapi.testclient import TestClient

    from snapkv_sessions.serve import Capacity, ServeOptions, Service, create_app

    service = Service(smollm2, {"compression": {"budget": 256, "window": 16}, "drift": {"embedder": "none"}}, store,
                      Capacity(batch=0, max_tokens=2))
    # a fault of the server is answered as a real client sees it (500, bounded), not raised into the test
    return TestClient(create_app(service, ServeOptions(**options)), raise_server_exceptions=False), service.model_id


def test_a_request_commits_whole_or_not_at_all_when_the_store_fails_midway(smollm2, tmp_path):
    from sqlalchemy import event

    store = SessionStore(f"sqlite:///{tmp_path / 's.db'}")
    client, model = _app(smollm2, store, max_messages=200)
    with client:
        first = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hi."}]})
        assert first.status_code == 200, first.text
        sid, reply = first.json()["session_id"], first.json()["choices"][0]["message"]["content"]
        held = [(m["seq"], m["hash"]) for m in store.messages(sid)]
        many = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": reply},
                *({"role": "user" if i % 2 == 0 else "assistant", "content": f"note {i}"} for i in range(197)),
                {"role": "user", "content": "Which note came last?"}]
        assert len(many) == 200  # at the cap: admitted
        armed = {"inserted": False}

        def fail_after_the_insert(_conn, _cursor, statement, *_args) -> None:
            if statement.startswith("INSERT INTO messages"):
                armed["inserted"] = True
            elif armed["inserted"] and statement.startswith("UPDATE sessions"):
                raise RuntimeError("the disk went away midway through the request's transaction")

        event.listen(store.engine, "before_cursor_execute", fail_after_the_insert)
        res = client.post("/v1/chat/completions", json={"model": model, "messages": many})
        event.remove(store.engine, "before_cursor_execute", fail_after_the_insert)
        assert res.status_code == 500 and "Traceback" not in res.text
        assert [(m["seq"], m["hash"]) for m in store.messages(sid)] == held  # none of the 198 new messages
        assert store.turns(sid, status="pending") == [] and store.verify(sid) == []
        again = client.post("/v1/chat/completions", json={"model": model, "messages": many})
        assert again.status_code == 200 and again.json()["session_id"] == sid, again.text
        assert len(store.messages(sid)) == len(held) + 198 + 1 and store.verify(sid) == []
        over = client.post("/v1/chat/completions", json={"model": model, "messages": [*many, *many[:1]]})
        assert over.status_code == 400 and over.json()["error"]["param"] == "messages"


@pytest.mark.service
def test_a_store_without_a_free_connection_answers_503_and_stores_nothing(smollm2):
    from conftest import pg_store

    pg_store()
    store = SessionStore(PG_URL, pool_size=1, pool_timeout_s=0.5)
    client, model = _app(smollm2, store)
    body = {"model": model, "messages": [{"role": "user", "content": f"Hello at {time.time()}."}]}
    with client:
        with store.engine.connect():  # the pool's one connection, held elsewhere
            t0 = time.perf_counter()
            res = client.post("/v1/chat/completions", json=body)
            assert time.perf_counter() - t0 < 3
        assert res.status_code == 503 and res.json()["error"]["code"] == "store_unavailable", res.text
        assert int(res.headers["Retry-After"]) >= 1
        assert not any(m["content"] == body["messages"][0]["content"] for r in store.list_sessions()
                       for m in store.messages(r["id"])[:1])
        ok = client.post("/v1/chat/completions", json=body)
        assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------- 8. the same conversation sent at once


def test_identical_requests_at_once_fork_from_the_boundary_instead_of_a_prefill(srv):
    """Eight identical requests at once on one conversation: one continues the session; the others that waited
    for it fork from a copy of its cache at that turn boundary (their first turn prefills the question alone, not
    the history). Every reply is the same (greedy), every session verifies, and each fork replays exactly."""
    base = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Rivers: " + ", ".join(f"R{i} is {100 + 7 * i} km" for i in range(60))}]
    first = _chat(srv, {"messages": base, "max_tokens": 6})
    assert first.status_code == 200
    source = first.json()["session_id"]
    msgs = [*base, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "How long is R7?"}]
    out = run_in_threads(lambda _i: _chat(srv, {"messages": msgs, "max_tokens": 6}).json(), range(8), 300)
    texts = {o["choices"][0]["message"]["content"] for o in out.values()}
    assert len(texts) == 1, texts
    store = SessionStore(f"sqlite:///{srv.db}")
    sids = [o["session_id"] for o in out.values()]
    assert sids.count(source) == 1
    history = len(store.turns(source)[0]["prefill_tokens"])
    prompts = {sid: out_row["usage"]["prompt_tokens"] for sid, out_row in zip(sids, out.values(), strict=True)}
    from_boundary = [sid for sid in sids if sid != source and store.get_session(sid)["meta"].get("forked_from")]
    assert from_boundary, prompts  # the waiters forked from the boundary
    for sid in from_boundary:
        assert prompts[sid] == prompts[source] < history / 4  # the question alone, as the continuing turn
        assert [t["turn"] for t in store.turns(sid)] == [1, 2]
        assert srv.post(f"/sessions/{sid}/verify").json()["ok"] is True
    print(f"forks: {len(from_boundary)} of 7 from the boundary, prompt {prompts[source]} tokens against "
          f"{history} for a prefill of the history")


def test_bench_forks_small_run():
    """``bench forks`` end to end: without kept boundaries every fork prefills the history, with them none does."""
    from click.testing import CliRunner

    from snapkv_sessions.cli import main

    _need_bundle()
    res = CliRunner().invoke(main, ["bench", "forks", "--requests", "3", "--batch", "2", "--document-tokens", "128",
                                    "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["boundaries"]: r for r in json.loads(res.output)["rows"]}
    assert rows[False]["forks"] == rows[True]["forks"] == 2 and rows[False]["from_boundary"] == 0
    assert rows[True]["from_boundary"] == 2 and rows[True]["same_reply"] and rows[False]["same_reply"]
    assert rows[True]["fork_prefill_tokens_median"] < rows[False]["fork_prefill_tokens_median"] / 4
