"""`snapkv-sessions serve` (issue 16): a live server in a subprocess (uvicorn, SmolLM2 bundle, SQLite), driven by
the official `openai` client, sync and async; plus the worker's queue and deadlines in process.

Everything binds to and talks to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import bundle_available, run_in_threads

openai = pytest.importorskip("openai")

from snapkv_sessions.bench.serve import start_server  # noqa: E402
from snapkv_sessions.serve.worker import Busy, DeadlineExceeded, Job, Worker  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY_A, KEY_B = "key-a-" + "a" * 20, "key-b-" + "b" * 20
POLICY = {"compression": {"budget": 256, "window": 16}, "pins": {"roles": ["system"], "sink_tokens": 4},
          "drift": {"embedder": "none"}}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


class Server:
    def __init__(self, tmp: Path, *args: str, policy: dict | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.db = tmp / "sessions.db"
        policy_file = tmp / "policy.json"
        policy_file.write_text(json.dumps(policy or POLICY))
        # fp32 whatever the CPU: these tests compare replies exactly (batched against alone, verify), and in
        # bf16 (serve's `auto` on a CPU with AVX-512 BF16) a batched reply can part from the same turn alone
        self.proc, self.url = start_server(MODEL, tmp, "--policy", str(policy_file), "--max-tokens", "12",
                                           "--warm-tokens", "64", "--dtype", "float32", *args,  # a short warm start
                                           wait_s=180)

    @staticmethod
    def auth(key: str | None) -> dict:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def get(self, path: str, key: str | None = KEY_A) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.auth(key), timeout=120)

    def post(self, path: str, body: dict | None = None, key: str | None = KEY_A, headers: dict | None = None):
        return httpx.post(f"{self.url}{path}", json=body, headers={**self.auth(key), **(headers or {})}, timeout=120)

    def delete(self, path: str, key: str | None = KEY_A) -> httpx.Response:
        return httpx.delete(f"{self.url}{path}", headers=self.auth(key), timeout=120)

    def stop(self) -> int:
        self.proc.terminate()  # uvicorn's graceful shutdown
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    srv = Server(tmp_path_factory.mktemp("serve"), "--api-key", KEY_A, "--api-key", KEY_B)
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down gracefully
    assert "Traceback" not in (srv.db.parent / "serve.log").read_text()


pytestmark = [pytest.mark.slow, pytest.mark.bundle]


def _turns(server: Server, session_id: str, key: str = KEY_A) -> list[dict]:
    res = server.get(f"/sessions/{session_id}", key)
    assert res.status_code == 200, res.text
    return res.json()["turns"]


def test_plain_and_streamed_completions_agree(server):
    client = server.client()
    msgs = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.object == "chat.completion"
    assert plain.usage.completion_tokens == _turns(server, plain.session_id)[-1]["tokens_out"] > 0
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text  # greedy: the same reply, streamed (a new session: the list does not extend one)
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)


@pytest.mark.parametrize("named", [True, False])
def test_three_turns_prefill_only_the_new_messages(server, named):
    """Each request sends the whole list; the second and third continue the first one's session (named by
    X-Session-Id, or found by the content hash of the list's prefix) and prefill only their new messages."""
    client = server.client()
    msgs = [SYSTEM, {"role": "user", "content": f"Pick a fruit ({named})."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6)
    sid = first.session_id
    for question in ("Why that one?", "Say it again."):
        msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": question}]
        extra = {"extra_headers": {"X-Session-Id": sid}} if named else {}
        first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, **extra)
        assert first.session_id == sid
    turns = _turns(server, sid)
    assert [t["turn"] for t in turns] == [1, 2, 3]
    # turns 2 and 3 prefill the pending reply token and their own message only, far fewer than the whole list
    assert turns[1]["tokens_in"] < turns[0]["tokens_in"] and turns[2]["tokens_in"] < turns[0]["tokens_in"]
    assert first.usage.prompt_tokens == turns[2]["tokens_in"]


def test_a_named_session_must_continue(server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Hi."}])
    other = [SYSTEM, {"role": "user", "content": "A different start."}, {"role": "assistant", "content": "Ok."},
             {"role": "user", "content": "Go on."}]
    res = server.post("/chat/completions", {"model": MODEL, "messages": other}, headers={"X-Session-Id": first.session_id})
    assert res.status_code == 409 and res.json()["error"]["code"] == "history_mismatch"


def test_fork_and_delete(server):
    client = server.client()
    msgs = [SYSTEM, {"role": "user", "content": "Count to three."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6)
    res = server.post(f"/sessions/{first.session_id}/fork", {"turn": 1})
    assert res.status_code == 200, res.text
    fork = res.json()["id"]
    assert fork != first.session_id and res.json()["messages"] == 3  # system, user, the reply
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Now backwards."}]
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                           extra_headers={"X-Session-Id": fork})
    assert again.session_id == fork and _turns(server, first.session_id)[-1]["turn"] == 1  # the original is unchanged
    assert server.post(f"/sessions/{fork}/verify").json()["ok"] is True
    assert server.delete(f"/sessions/{fork}").json()["deleted"] is True
    assert server.get(f"/sessions/{fork}").status_code == 404
    assert server.post(f"/sessions/{first.session_id}/fork", {"turn": 7}).status_code == 400


def test_tool_definitions_and_a_tool_result_round_trip(server):
    """The client's assistant tool call and the tool's result are stored as the model would have written them;
    the session continues with them, and the next request (the reply appended) continues the same session."""
    client = server.client()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    msgs = [SYSTEM, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=8)
    stored = server.get(f"/sessions/{first.session_id}").json()
    assert stored["turns"][0]["turn"] == 1
    reply = first.choices[0].message
    msgs.append({"role": "assistant", "content": reply.content,
                 **({"tool_calls": [c.model_dump() for c in reply.tool_calls]} if reply.tool_calls else {})})
    msgs.append({"role": "user", "content": "Thanks."})
    second = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=8)
    assert second.session_id == first.session_id


def test_keys_scope_sessions(server):
    a, b = server.client(KEY_A), server.client(KEY_B)
    first = a.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Secret: 42."}])
    sid = first.session_id
    for res in (server.get(f"/sessions/{sid}", KEY_B), server.post(f"/sessions/{sid}/fork", {}, KEY_B),
                server.post(f"/sessions/{sid}/verify", None, KEY_B), server.delete(f"/sessions/{sid}", KEY_B),
                server.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                            KEY_B, headers={"X-Session-Id": sid})):
        assert res.status_code == 404 and res.json()["error"]["code"] == "session_not_found", res.text
    # streamed too: the session is resolved before the stream opens, so the status is the 404
    res = server.post("/chat/completions", {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]},
                      KEY_B, headers={"X-Session-Id": sid})
    assert res.status_code == 404 and res.json()["error"]["code"] == "session_not_found", res.text
    res = server.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                      KEY_A, headers={"X-Session-Id": "../not a session"})
    assert res.status_code == 400 and res.json()["error"]["param"] == "session_id"
    assert sid not in {s["id"] for s in server.get("/sessions", KEY_B).json()["data"]}
    assert sid in {s["id"] for s in server.get("/sessions", KEY_A).json()["data"]}
    # B sending A's exact conversation starts B's own session: the content lookup is scoped to the caller
    msgs = [SYSTEM, {"role": "user", "content": "Secret: 42."},
            {"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Again?"}]
    assert b.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4).session_id != sid
    for key in (None, "wrong-key-" + "x" * 20):
        res = server.get("/models", key)
        assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"model": "gpt-4o"}, "model"),
    ({"temperature": 5}, "temperature"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
])
def test_bad_requests_name_the_field(server, body, param):
    full = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    res = server.post("/chat/completions", full)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and len(err["message"]) < 1200


def test_bodies_that_are_not_json_or_too_large_are_refused(server):
    res = httpx.post(f"{server.url}/chat/completions", content=b"{not json", timeout=60,
                     headers={**server.auth(KEY_A), "Content-Type": "application/json"})
    assert res.status_code == 400 and res.json()["error"]["code"] == "invalid_json"
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    res = server.post("/chat/completions", huge)
    assert res.status_code == 413 and res.json()["error"]["code"] == "body_too_large"
    res = httpx.post(f"{server.url}/sessions/whatever/fork", content=b"[1, 2]", headers=server.auth(KEY_A), timeout=60)
    assert res.status_code == 400 and res.json()["error"]["param"] == "body"


def test_async_client_streams(server):
    async def go():
        client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY_A, max_retries=0, timeout=120)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Say yes."}], max_tokens=5, stream=True)
        return [c async for c in stream]

    chunks = asyncio.run(go())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_client_leaving_mid_stream_abandons_the_turn(server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {"role": "user", "content": "Hello."}],
                                           max_tokens=4)
    sid = first.session_id
    msgs = [SYSTEM, {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Write a long story about a lighthouse."}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=120,
                      headers={**server.auth(KEY_A), "X-Session-Id": sid}) as res:
        assert res.status_code == 200
        for line in res.iter_lines():
            if line.startswith("data:") and '"content"' in line and '""' not in line:
                break  # one piece of the reply arrived: leave
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        statuses = [t["status"] for t in _turns(server, sid)]
        if statuses[-1] != "pending":
            break
        time.sleep(0.5)
    assert statuses == ["done", "abandoned"]
    assert server.post(f"/sessions/{sid}/verify").json()["ok"] is True
    # the session goes on from its last done turn
    again = client.chat.completions.create(model=MODEL, messages=msgs[:3] + [{"role": "user", "content": "Bye."}],
                                           max_tokens=4, extra_headers={"X-Session-Id": sid})
    assert again.session_id == sid and [t["status"] for t in _turns(server, sid)][-1] == "done"


def test_backpressure_and_graceful_shutdown(tmp_path):
    """A queue of one: while a turn streams and another waits, a third request is refused at once with 429 and
    Retry-After. SIGTERM mid-stream: the waiting request is refused with 503 and Retry-After (it never ran, so
    nothing is stored for it), the running stream finishes within the grace or ends with an error event, and no
    turn is left pending."""
    from snapkv_sessions.store import SessionStore

    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    srv = Server(tmp_path, "--api-key", KEY_A, "--max-queue", "1", "--batch", "1")  # one turn runs at a time
    streaming, results = threading.Event(), {}

    def stream():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 120,
                "stream": True}
        with httpx.stream("POST", f"{srv.url}/chat/completions", json=body, headers=srv.auth(KEY_A), timeout=120) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data:"):
                    streaming.set()
                    last = line[5:].strip()
            results["stream"] = "stopped" if last and last != "[DONE]" and "error" in json.loads(last) else "complete"

    def queued():
        res = srv.post("/chat/completions", {"model": MODEL, "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "Hi."}]})
        results["queued"] = (res.status_code, res.headers.get("Retry-After"), res.json()["error"]["code"])

    threads = [threading.Thread(target=stream)]
    threads[0].start()
    try:
        assert streaming.wait(60)
        threads.append(threading.Thread(target=queued))
        threads[1].start()
        time.sleep(0.5)  # the second request now waits in the queue
        busy = srv.post("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hey."}]})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        assert int(busy.headers["Retry-After"]) >= 1
        code = srv.stop()  # SIGTERM while the stream runs
    finally:
        if srv.proc.poll() is None:  # an assertion failed before the stop: never leave the server running
            srv.stop()
        for t in threads:
            t.join(120)
    assert code in (0, -signal.SIGTERM) and results["queued"] == (503, "5", "shutting_down")
    store = SessionStore(f"sqlite:///{srv.db}")
    statuses = {}
    for row in store.list_sessions():
        assert store.pending_turn(row["id"]) is None and store.verify(row["id"]) == []
        statuses[store.messages(row["id"])[0]["content"]] = [t["status"] for t in store.turns(row["id"])]
    # the streamed turn finished, or was stopped cleanly after the grace; the queued one never ran
    expected = ["done"] if results["stream"] == "complete" else ["abandoned"]
    assert statuses == {"Tell a long story.": expected}
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_a_request_past_its_deadline_gets_504_and_abandons_its_turn(tmp_path):
    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    srv = Server(tmp_path, "--request-timeout", "5")
    try:
        msgs = [{"role": "user", "content": "Write a very long essay about rivers."}]
        res = srv.post("/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2000}, key=None)
        assert res.status_code == 504 and res.json()["error"]["code"] == "deadline_exceeded"
        ok = srv.post("/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 3}, key=None)
        assert ok.status_code == 200, ok.text  # without keys: local use
    finally:
        srv.stop()
    from snapkv_sessions.store import SessionStore

    store = SessionStore(f"sqlite:///{srv.db}")
    turns = sorted(([t["status"] for t in store.turns(r["id"])] for r in store.list_sessions()), key=len)
    assert sorted(turns) == [["abandoned"], ["done"]]  # a session of abandoned turns alone continues nothing


def _conversations(srv: Server, clients: int, turns: list[str]) -> dict[int, list[str]]:
    """``clients`` concurrent clients, each a multi-turn conversation sent whole every turn (greedy); their
    replies, by client."""

    def client(i: int) -> list[str]:
        replies = []
        messages = [{"role": "system", "content": f"You are assistant {i}. Be brief."}]
        for question in turns:
            messages.append({"role": "user", "content": question})
            res = srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10 + 3 * i,
                                                       stop=["\n\n"] if i % 2 else None)
            text = res.choices[0].message.content
            replies.append(text)
            messages.append({"role": "assistant", "content": text})
        return replies

    return run_in_threads(client, range(clients), 300)


def test_batched_server_replies_equal_the_unbatched_server(tmp_path):
    """Four clients at once, three turns each, different reply caps and stops: the batched server's replies equal
    the one-at-a-time server's, and its sessions replay clean."""
    from snapkv_sessions.store import SessionStore

    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    turns = ["Name three rivers in Europe.", "Which of them is the longest?", "Say one thing about it."]
    replies = {}
    for batch in ("0", "4"):
        srv = Server(tmp_path / f"batch{batch}", "--api-key", KEY_A, "--batch", batch)
        try:
            replies[batch] = _conversations(srv, 4, turns)
            if batch == "4":
                sessions = srv.get("/sessions").json()["data"]
                assert len(sessions) == 4 and all(s["turns"] == 3 for s in sessions)
                for s in sessions:
                    assert srv.post(f"/sessions/{s['id']}/verify").json()["ok"] is True
        finally:
            srv.stop()
        store = SessionStore(f"sqlite:///{srv.db}")
        assert all(store.pending_turn(r["id"]) is None for r in store.list_sessions())
    assert replies["4"] == replies["0"]


def test_decode_rate_counts_the_time_any_turn_was_decoding():
    from snapkv_sessions.bench.serve import TurnTiming, decode_rate

    def turn(n, span):
        return TurnTiming(0, 1, 200, 1.0, 1.0, n, 5, span)

    # two overlapping spans (0-2, 1-3) and one apart (5-6): 4 s busy, (11-1) + (5-1) + (3-1) tokens after the first
    assert decode_rate([turn(11, (0.0, 2.0)), turn(5, (1.0, 3.0)), turn(3, (5.0, 6.0))]) == 4.0
    assert decode_rate([turn(1, None)]) is None


def test_bench_serve_small_run():
    from click.testing import CliRunner

    from snapkv_sessions.cli import main

    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    res = CliRunner().invoke(main, ["bench", "serve", "--model", MODEL, "--clients", "1,2", "--turns", "2",
                                    "--max-tokens", "4", "--batch", "0,2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [(r["batch"], r["clients"]) for r in out["levels"]] == [(0, 1), (0, 2), (2, 1), (2, 2)]
    assert [r["turns"] for r in out["levels"]] == [2, 4, 2, 4]
    assert [r["speedup"] for r in out["levels"][:2]] == [1.0, 1.0] and all(r["speedup"] for r in out["levels"])
    assert all(r["errors"] == 0 and r["status_429"] == 0 and r["completion_tokens"] > 0 for r in out["levels"])
    assert all(r["ttft_ms_p50"] > 0 and r["tokens_per_s"] > 0 for r in out["levels"])
    # every client's second turn continued its session: it prefilled fewer tokens than its first
    for turns in out["turns"].values():
        by_client = {}
        for t in turns:
            by_client.setdefault(t["client"], {})[t["turn"]] = t["prompt_tokens"]
        assert all(c[2] < c[1] for c in by_client.values())


# ---------------------------------------------------------------------- the worker, in process


def test_a_waiting_job_whose_client_left_never_starts():
    worker = Worker(max_queue=2)
    gate, ran = threading.Event(), []
    try:
        first = worker.submit(lambda job: gate.wait(10), timeout_s=30)
        time.sleep(0.2)
        left = worker.submit(lambda job: ran.append(1), timeout_s=30)
        left.cancelled.set()  # the client disconnected while its request waited
        gate.set()
        assert first.future.result(5) is True
        with pytest.raises(DeadlineExceeded):
            left.future.result(5)
        assert ran == []
    finally:
        gate.set()
        worker.close()
    with pytest.raises(ValueError, match="max_queue=0"):
        Worker(max_queue=0)


def test_a_full_queue_refuses_at_once_and_a_late_job_never_starts():
    worker = Worker(max_queue=1, typical_job_s=2.0)
    gate = threading.Event()
    try:
        running = worker.submit(lambda job: gate.wait(10), timeout_s=30)
        time.sleep(0.2)  # the first job is running; the queue is empty again
        late = worker.submit(lambda job: "ran", timeout_s=0.1)  # waits behind it past its deadline
        with pytest.raises(Busy) as busy:
            worker.submit(lambda job: "ran", timeout_s=30)
        assert busy.value.retry_after == 2
        time.sleep(0.3)
        gate.set()
        assert running.future.result(5) is True
        with pytest.raises(DeadlineExceeded):
            late.future.result(5)
    finally:
        gate.set()
        worker.close()


def test_a_retried_request_that_ran_gets_the_stored_reply_and_no_second_turn(tmp_path):
    """What a router does when a replica died after running a turn: the request is sent again, marked as a retry,
    under the session id it chose; the reply comes from the store, equal to the first, and no turn runs twice."""
    import uuid

    from snapkv_sessions.serve import protocol
    from snapkv_sessions.serve.service import Capacity, Conflict, Service
    from snapkv_sessions.store import SessionStore

    if not bundle_available(MODEL):
        pytest.skip(f"bundle {MODEL} not installed")
    service = Service(MODEL, POLICY, SessionStore(f"sqlite:///{tmp_path}/s.db"), Capacity(batch=2))
    body = {"model": MODEL, "max_tokens": 6, "stop": ["."],
            "messages": [SYSTEM, {"role": "user", "content": "Name a river in Europe."}]}
    sid = str(uuid.uuid4())

    def send(create: bool, retried: bool):
        turn = service.prepare(protocol.parse(body), None, sid)
        turn.create, turn.retried = create, retried
        return service.chat(turn, Job(lambda _job: None, time.monotonic() + 120))

    try:
        first = send(create=True, retried=False)
        again = send(create=True, retried=True)
        assert (again.content, again.finish, again.session_id) == (first.content, first.finish, sid)
        assert (again.reply.turn, again.reply.token_ids, again.reply.context_tokens) == (
            first.reply.turn, first.reply.token_ids, first.reply.context_tokens)
        assert [t["status"] for t in service.store.turns(sid)] == ["done"]
        with pytest.raises(Conflict):  # the same request, not marked as a retry, continues nothing
            send(create=False, retried=False)
    finally:
        service.close()


def test_the_resolver_finds_continued_answered_and_new_by_content(tmp_path):
    """The one rule the server, the Ray ingress and LangChain resolve a message list with: a session continues a
    list when what it stored (a reply as it was returned) is a proper prefix of it; a retry of a list it answered
    is "answered"; anything else is "new". Found by content hash, else by reading the caller's recent sessions."""
    from snapkv_sessions.chat import Message
    from snapkv_sessions.conversations import Resolution, find_continued, prefix_heads, resolve
    from snapkv_sessions.store import NewMessage, SessionStore

    store, sha = SessionStore(f"sqlite:///{tmp_path}/s.db"), "p" * 64

    def stored(reply: str, stop: list[str]) -> str:
        sid = store.create_session(MODEL, "{}", sha, owner="o", messages=[NewMessage("system", "Be brief.")])
        turn, _ = store.begin_turn(sid, "Hi", None, sha, MODEL, {"max_new_tokens": 4, "stop": stop}, None)
        store.finish_turn(sid, turn, reply, {"tokens_in": 1}, [], {})
        return sid

    plain, cut = stored("Hello.", []), stored("Bye. And more", [" And"])  # the second as shown: "Bye."
    asked = [Message("system", "Be brief."), Message("user", "Hi")]
    more = Message("user", "More?")
    wanted = [*asked, Message("assistant", "Hello."), more]

    assert resolve((store, plain), wanted, None) == Resolution("continued", plain, (more,))
    assert resolve((store, plain), asked, None, retried=True) == Resolution("answered", plain, ())
    assert resolve((store, plain), asked, None) == Resolution("new", None, tuple(asked))
    other = [Message("user", "Other"), more]
    assert resolve((store, plain), other, None) == Resolution.start(other)
    assert list(prefix_heads(wanted).values()) == [1, 2, 3]

    def find(msgs: list[Message], owner: str = "o", policy: str = sha) -> Resolution:
        return find_continued(store, msgs, None, owner=owner, model_id=MODEL, policy_sha256=policy)

    assert find(wanted) == Resolution("continued", plain, (more,))  # by the content hash of its chain
    shown = [*asked, Message("assistant", "Bye."), more]
    assert find(shown) == Resolution("continued", cut, (more,))  # the stored reply was cut: by reading it
    assert find(wanted, owner="x") == find(wanted, policy="q" * 64) == Resolution.start(wanted)
    assert find(asked[:1] + [more]) == Resolution("new", None, (asked[0], more))
