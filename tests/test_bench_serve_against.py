"""``bench serve --against URL`` (issue 30 item 4): the same multi-turn workload against other OpenAI-compatible
servers, side by side with ours. The other servers are fakes in this process (``http.server`` on free loopback
ports) that stream a fixed reply in SSE chunks and a usage chunk, and record every request body; ours runs on a
tiny random Llama. Everything talks to 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from snapkv_sessions.bench import serve as serve_bench
from snapkv_sessions.cli import main

PIECES = ["The Danube", ", the Rhine", " and the Po."]  # one reply, three content chunks, 3 completion tokens


class Fake:
    """A fake OpenAI-compatible server: ``GET /v1/models`` names ``model``; every ``POST /v1/chat/completions``
    streams :data:`PIECES` (one chunk each), then a usage chunk, then ``[DONE]``, and its body is recorded."""

    def __init__(self, model: str = "fake-model") -> None:
        self.bodies: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._send(200, json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
                events += [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in PIECES]
                events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                           {"choices": [], "usage": {"prompt_tokens": 7 * len(body["messages"]),
                                                     "completion_tokens": len(PIECES), "total_tokens": 0}}]
                data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self._send(200, data.encode(), "text/event-stream")

            def _send(self, status: int, data: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made = [Fake(), Fake()]
    yield made
    for f in made:
        f.close()


def _invoke(*args: str):
    return CliRunner().invoke(main, ["bench", "serve", *args])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_requests_reach_every_other_server(fakes):
    a, b = fakes
    res = _invoke("--against", f"{a.url},{b.url}", "--against-pid", str(os.getpid()), "--against-only",
                  "--clients", "1,2", "--turns", "3", "--max-tokens", "8", "--document-tokens", "64", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [(r["server"], r["clients"]) for r in out["levels"]] == [
        (f"{a.url} (fake-model)", 1), (f"{a.url} (fake-model)", 2), (f"{b.url} (fake-model)", 1),
        (f"{b.url} (fake-model)", 2)]
    assert [r["turns"] for r in out["levels"]] == [3, 6, 3, 6]  # every client ran all its turns
    assert [r["completion_tokens"] for r in out["levels"]] == [9, 18, 9, 18]  # read from each stream's usage
    assert all(r["errors"] == 0 and r["kind"] == "against" and r["speedup"] is None for r in out["levels"])
    assert all(r["ttft_first_ms_p50"] > 0 and r["ttft_later_ms_p50"] > 0 for r in out["levels"])
    # one warm-up, then 1 x 3 and 2 x 3 turns, each server
    assert len(a.bodies) == len(b.bodies) == 1 + 3 + 6
    assert sorted(map(json.dumps, a.bodies)) == sorted(map(json.dumps, b.bodies))  # identical bodies
    for body in a.bodies[1:]:
        assert (body["model"], body["max_tokens"], body["temperature"], body["stream"], body["stream_options"]) == (
            "fake-model", 8, 0, True, {"include_usage": True})
        msgs = body["messages"]
        assert [m["role"] for m in msgs] == ["system", *["user", "assistant"] * ((len(msgs) - 2) // 2), "user"]
        assert all(m["content"] == "".join(PIECES) for m in msgs if m["role"] == "assistant")  # its own replies
        assert msgs[1]["content"].startswith("Record 0:")  # the document opens the first turn
    # the whole conversation each turn: the two-client level's bodies hold 2, 4 and 6 messages per client
    assert sorted(len(x["messages"]) for x in a.bodies[4:]) == [2, 2, 4, 4, 6, 6]
    servers = out["servers"]
    assert [s["at_clients"] for s in servers] == [1, 1] and out["ratios"] == []
    assert servers[0]["rss_bytes"] > 0 and servers[1]["rss_bytes"] is None  # --against-pid: the first only
    text = serve_bench.table(out)  # one row-group per server, each headed by its summary
    assert text.count("TTFT p50 first/later turns") == 2 and f"{b.url} (fake-model): " in text


def test_a_remote_server_is_refused_unless_allowed():
    res = _invoke("--against", "http://10.20.30.40:8000/v1", "--against-only", "--json")
    assert res.exit_code == 2
    assert "--against" in res.output and "--allow-remote" in res.output and "10.20.30.40" in res.output
    long = "http://example.com/" + "x" * 5000
    res = _invoke("--against", long, "--against-only", "--json")
    assert res.exit_code == 2 and "--allow-remote" in res.output and len(res.output) < 1200  # a bounded view
    res = _invoke("--against", "ftp://127.0.0.1/v1", "--against-only")
    assert res.exit_code == 2 and "base URL" in res.output


def test_a_server_that_is_down_is_named_before_anything_runs():
    url = f"http://127.0.0.1:{_free_port()}/v1"
    res = _invoke("--against", url, "--json")  # ours would start after the check: it never does
    assert res.exit_code == 1
    assert url in res.output and "running" in res.output and "Traceback" not in res.output
    res = _invoke("--against", url, "--against-model", "m", "--against-only")
    assert res.exit_code == 1 and url in res.output and "running" in res.output


def test_option_checks():
    assert _invoke("--against-only").exit_code == 2
    res = _invoke("--budgets", "full,1.5", "--against-only", "--against", "http://127.0.0.1:1/v1")
    assert res.exit_code == 2 and "--budgets" in res.output
    res = _invoke("--against", "http://127.0.0.1:1/v1", "--against-model", "a,b", "--against-only")
    assert res.exit_code == 2 and "--against-model" in res.output


def test_budgets_make_policies():
    bench = serve_bench.ServeBench("m", [1], budgets=("full", 0.2))
    full, ratio = bench.sessions_policy("full"), bench.sessions_policy(0.2)
    assert full["compression"]["budget"] == serve_bench.FULL_BUDGET and full["min_prompt_tokens"] >= 1 << 30
    assert (full["drift"]["embedder"], full["memory"]["cold"]) == ("none", False)  # no compression, nothing to recover
    assert (ratio["compression"]["budget"], ratio["compression"]["budget_ratio"]) == (None, 0.2)
    assert (ratio["compression"]["window"], ratio["compression"]["pin_overflow"]) == (16, "grow")
    agent = serve_bench.ServeBench("m", [1], policy="agent-strict").sessions_policy(0.5)
    assert agent["compression"]["budget_ratio"] == 0.5 and agent["pins"]["markers"] == ["MUST", "NEVER"]


def test_ratios_are_ours_over_theirs():
    def level(n, tps, first, later, stream, rss):
        return serve_bench.Level(n, 1, 1.0, 1, tps, tps, 1.0, 1.0, 1.0, 1.0, first, later, stream, 0, 0, [], [], rss)

    ours = serve_bench.ServerRun(serve_bench.Target("ours", batch=8, budget=0.2),
                                 [level(1, 10.0, 300.0, 50.0, 10.0, 100), level(4, 30.0, 900.0, 90.0, 8.0, 300)])
    theirs = serve_bench.ServerRun(serve_bench.Target("against", "http://127.0.0.1:1/v1", "x"),
                                   [level(1, 20.0, 100.0, 100.0, 20.0, 400), level(4, 20.0, 0.0, 1.0, 1.0, None)])
    r = serve_bench.Ratios.of(ours, theirs)
    assert (r.ttft_first, r.ttft_later, r.stream_decode, r.rss) == (3.0, 0.5, 0.5, 0.75)  # rss: the largest read
    assert r.tokens_per_s == {"1": 0.5, "4": 1.5} and r.ours == "ours batch=8,packed=auto,budget=0.2"


def test_agreement_counts_turns_first_turns_and_whole_conversations_against_our_full_cache():
    def turn(client, t, reply, status=200):
        return serve_bench.TurnTiming(client, t, status, 1.0, 1.0, 3, 5, reply=reply)

    def run(target, *turns):
        return serve_bench.ServerRun(target, [serve_bench.Level(2, len(turns), 1.0, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
                                                                1.0, 1.0, 1.0, 0, 0, [], list(turns))])

    full = run(serve_bench.Target("ours", batch=8, budget="full"),
               turn(0, 1, "a"), turn(0, 2, "b"), turn(1, 1, "c"), turn(1, 2, "d"))
    # client 0 equal on both turns; client 1's first turn differs; its second equal again; a refused turn not counted
    small = run(serve_bench.Target("ours", batch=8, budget=0.2),
                turn(0, 1, "a"), turn(0, 2, "b"), turn(1, 1, "x"), turn(1, 2, "d"))
    other = run(serve_bench.Target("against", "http://127.0.0.1:1/v1", "m"),
                turn(0, 1, "a"), turn(0, 2, "", status=429), turn(1, 1, "c"))
    rows = serve_bench.agreements([small, full, other])
    assert [(a.server.split(" ")[0], a.equal, a.compared, a.first_equal, a.conversations_equal, a.conversations)
            for a in rows] == [("ours", 3, 4, 1, 1, 2), ("http://127.0.0.1:1/v1", 2, 2, 2, 2, 2)]
    assert all(a.reference == full.target.label and a.clients == 2 for a in rows)
    assert serve_bench.agreements([small, other]) == []  # no full-cache server: nothing to compare with
    text = serve_bench.table({"levels": [], "agreement": [asdict(a) for a in rows]})
    assert "3/4 (1/2; 1/2)" in text and "2/2 (2/2; 2/2)" in text


def test_step_figures_are_the_metrics_deltas_per_step(fakes):
    assert serve_bench.step_figures((1.0, 10.0, 10.0), (3.0, 20.0, 30.0)) == (200.0, 2.0)
    assert serve_bench.step_figures((1.0, 10.0, 10.0), (1.0, 10.0, 10.0)) == (None, None)  # no step between
    assert serve_bench.step_figures(None, (1.0, 1.0, 1.0)) == (None, None)
    assert serve_bench.step_totals(fakes[0].url) is None  # a server without our series
    assert serve_bench.step_totals(f"http://127.0.0.1:{_free_port()}/v1") is None  # nobody there


def test_tree_rss_counts_the_children():
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(1.0)
        own = serve_bench._vm_rss(os.getpid())
        assert serve_bench.tree_rss_bytes(os.getpid()) >= own + (60 << 20)
    finally:
        child.kill()
        child.wait()
    assert serve_bench.tree_rss_bytes(child.pid) is None  # gone


@pytest.mark.slow
def test_ours_at_two_budgets_beside_another_server(tmp_path):
    from tests.conftest import build_tiny, word_tokenizer

    folder = tmp_path / "model"
    build_tiny("llama").save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"compression": {"budget": 256, "window": 16}, "drift": {"embedder": "none"}}))
    fake = Fake()
    try:
        res = _invoke("--model", str(folder), "--policy", str(policy), "--budgets", "full,0.5", "--batch", "0",
                      "--clients", "1", "--turns", "2", "--max-tokens", "4", "--against", fake.url, "--json")
    finally:
        fake.close()
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [(r["kind"], r["budget"], r["turns"], r["errors"]) for r in out["levels"]] == [
        ("ours", "full", 2, 0), ("ours", 0.5, 2, 0), ("against", None, 2, 0)]
    assert [r["speedup"] for r in out["levels"]] == [1.0, 1.0, None]  # each budget's own one-at-a-time server
    # our servers' own decode step beside the clients' TPOT (GET /metrics); the other server has no such series
    assert [(r["step_rows_mean"], r["step_ms_mean"] is not None and r["step_ms_mean"] > 0)
            for r in out["levels"]] == [(1.0, True), (1.0, True), (None, False)]
    ours = [s for s in out["servers"] if s["kind"] == "ours"]
    assert all(s["rss_bytes"] > 50 << 20 for s in ours)  # our server's process tree, read from /proc
    assert [(x["ours"].split("budget=")[1], x["theirs"]) for x in out["ratios"]] == [
        ("full", f"{fake.url} (fake-model)"), ("0.5", f"{fake.url} (fake-model)")]
    assert all(x["ttft_first"] and x["tokens_per_s"]["1"] for x in out["ratios"])
    # the other server got the same first turn ours did, and then its own reply back
    first = next(b for b in fake.bodies if b["messages"][0]["role"] == "system")
    assert first["messages"][1]["content"] == serve_bench.QUESTIONS[0] and len(fake.bodies) == 3
    assert out["turns"][next(k for k in out["turns"] if "budget=full" in k)][1]["prompt_tokens"] > 0
    # both other servers' replies compared with our full cache's, turn by turn
    assert [(a["server"].split("budget=")[-1], a["compared"]) for a in out["agreement"]] == [
        ("0.5", 2), (f"{fake.url} (fake-model)", 2)]


def test_metrics_both_runs_each_server_with_and_without_and_gives_the_ratio(monkeypatch):
    """--metrics both: one server with GET /metrics and one with serve --no-metrics per setting, side by side, and
    vs_no_metrics = tokens/s with / without on the rows with metrics."""
    started = []

    def fake(bench, target, log):
        started.append(target)
        tps = 9.0 if target.metrics else 10.0
        return serve_bench.ServerRun(target, [serve_bench.Level(1, 1, 1.0, 1, tps, tps, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
                                                                tps, 0, 0, [], [], None)])

    monkeypatch.setattr(serve_bench, "_one_server", fake)
    bench = serve_bench.ServeBench("m", [1], batches=(8,), metrics=(False, True))
    out = serve_bench.run(bench, log=lambda _m: None)
    assert [t.metrics for t in started] == [False, True]
    assert "metrics=off" in started[0].label and "metrics" not in started[1].label
    ratio = {r["metrics"]: r["vs_no_metrics"] for r in out["levels"]}
    assert ratio == {True: 0.9, False: None}
    assert "with GET /metrics / without" in serve_bench.table(out)


def test_the_command_builds_its_bench_with_every_option():
    """bench serve's options reach ServeBench by name (a field added to the dataclass cannot shift the others):
    the run gets as far as the --against server, which does not answer."""
    from click.testing import CliRunner

    from snapkv_sessions.cli import main

    res = CliRunner().invoke(main, ["bench", "serve", "--model", "m", "--metrics", "both", "--packed-weights", "both",
                                    "--document-tokens", "300", "--against-only", "--against",
                                    "http://127.0.0.1:1/v1", "--against-model", "x"])
    assert res.exit_code != 0 and "TypeError" not in res.output and "127.0.0.1:1" in res.output
