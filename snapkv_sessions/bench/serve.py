"""``bench serve``: N concurrent clients against ``snapkv-sessions serve``, each a multi-turn session.

Every client streams its turns through the OpenAI wire format (SSE, ``stream_options.include_usage``) and sends
the whole conversation each time, as agent frameworks do. Per turn: time to the first content token (TTFT), time
per output token after it (TPOT), completion tokens; per level of concurrency: aggregate completion tokens per
second over the wall time, aggregate decode tokens per second (:func:`decode_rate`), p50/p95 of TTFT and TPOT,
429s and other errors. Servers with and without batching (and packed weights) run one after another in one run,
and every row's ratios are to the one-turn-at-a-time server's at the same N. The server runs in a subprocess on a
free loopback port with a private SQLite store, unless ``base_url`` names a running one.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

QUESTIONS = ["Name three rivers in Europe.", "Which of them is the longest?", "Write one sentence about it.",
             "Now name a river in Asia.", "Compare the two in one sentence."]


@dataclass
class TurnTiming:
    client: int
    turn: int
    status: int
    ttft_ms: float | None
    tpot_ms: float | None
    completion_tokens: int
    prompt_tokens: int
    decoding: tuple[float, float] | None = None  # (first, last) content piece, perf_counter seconds
    session_id: str | None = None  # the session that served the turn


def start_server(model: str, folder: Path, *args: str, wait_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """``snapkv-sessions serve --model model`` on a free loopback port with the store ``folder/sessions.db`` and
    ``args`` (more serve options); its output goes to ``folder/serve.log``. Returns once it answers any request
    (a 401 included), with the process and its ``/v1`` URL. Used by ``bench serve``, the examples and the tests."""
    with socket.socket() as s:  # a free port: bound, read, released
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "snapkv_sessions.cli", "serve", "--model", model, "--db",
           str(folder / "sessions.db"), "--port", str(port), *args]
    log = folder / "serve.log"
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            httpx.get(f"{url}/models", timeout=2)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not answer within {wait_s:.0f} s")


def stream_turn(url: str, model: str, messages: list[dict], max_tokens: int, client: int, turn: int,
                key: str | None) -> tuple[TurnTiming, str]:
    """One streamed request; its timing and the reply text."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0, first, last, text, usage, session_id = time.perf_counter(), None, None, [], {}, None
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=600) as res:
        if res.status_code != 200:
            res.read()
            return TurnTiming(client, turn, res.status_code, None, None, 0, 0), ""
        for line in res.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            session_id = chunk.get("session_id") or session_id
            piece = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(piece)
    n = usage.get("completion_tokens", 0)
    ttft = None if first is None else (first - t0) * 1e3
    tpot = None if first is None or n < 2 else (last - first) * 1e3 / (n - 1)
    span = None if first is None or n < 2 else (first, last)
    return TurnTiming(client, turn, 200, ttft, tpot, n, usage.get("prompt_tokens", 0), span, session_id), "".join(text)


def document(client: int, tokens: int) -> str:
    """A made-up record list of about ``tokens`` tokens (about four characters per token), different per client."""
    lines, size, i = [], 0, 0
    while size < tokens * 4:
        line = f"Record {i}: the river R{client}-{i} is {(i * 37 + client * 11) % 900 + 100} km long."
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(lines)


def run_clients(url: str, model: str, clients: int, bench: ServeBench, key: str | None) -> dict:
    timings: list[TurnTiming] = []
    errors: list[str] = []
    lock = threading.Lock()
    turns, max_tokens = bench.turns, bench.max_tokens

    def client(i: int) -> None:
        messages = [{"role": "system", "content": f"You are assistant number {i}. Be brief."}]
        for t in range(turns):
            question = QUESTIONS[t % len(QUESTIONS)]
            if t == 0 and bench.document_tokens:
                question = f"{document(i, bench.document_tokens)}\n\n{question}"
            messages.append({"role": "user", "content": question})
            try:
                timing, reply = stream_turn(url, model, messages, max_tokens, i, t + 1, key)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            with lock:
                timings.append(timing)
            if timing.status != 200:
                return
            messages.append({"role": "assistant", "content": reply})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    ok = [t for t in timings if t.status == 200]
    ttft = [t.ttft_ms for t in ok if t.ttft_ms is not None]
    tpot = [t.tpot_ms for t in ok if t.tpot_ms is not None]
    tokens = sum(t.completion_tokens for t in ok)
    return {"clients": clients, "turns": len(ok), "wall_s": round(wall, 2), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2) if wall else None,
            "decode_tokens_per_s": decode_rate(ok),
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95),
            "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p95": _pct(tpot, 95),
            "status_429": sum(t.status == 429 for t in timings),
            "errors": len(errors) + sum(t.status not in (200, 429) for t in timings), "error_samples": errors[:3],
            "per_turn": [asdict(t) for t in timings]}


def decode_rate(turns: list[TurnTiming]) -> float | None:
    """Aggregate decode tokens/s: the tokens after each turn's first, over the time at least one turn was decoding
    (the union of the turns' first-to-last-token spans). One turn at a time, it is 1/TPOT; batched, it counts
    the decode steps shared, and prefills that ran while some turn was decoding count against it."""
    spans = sorted(t.decoding for t in turns if t.decoding is not None)
    busy, end = 0.0, None
    for lo, hi in spans:
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    tokens = sum(t.completion_tokens - 1 for t in turns if t.decoding is not None)
    return round(tokens / busy, 2) if busy else None


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


@dataclass
class ServeBench:
    """What ``bench serve`` runs: the model, the concurrency levels, the turns, and the servers to compare."""

    model: str
    levels: list[int]
    turns: int = 3
    max_tokens: int = 32
    batches: tuple[int, ...] = (0, 8)  # one server per value: 0 decodes one turn at a time
    max_queue: int = 16
    policy: str | None = None  # a policy name or YAML path; None: ``budget``
    budget: int = 512
    packed: tuple[bool, ...] = (False,)  # servers with and/or without packed linear weights (snapkv_sessions.packed)
    document_tokens: int = 0  # each client's first message starts with a document of about this many tokens

    def sessions_policy(self) -> str | dict:
        """The servers' policy: ``policy`` when given, else ``budget`` with a 16-token window."""
        return self.policy or {"compression": {"budget": self.budget, "window": 16}}


def launch(bench: ServeBench, folder: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """:func:`start_server` with the bench's model and policy (a policy given as a mapping is written to a file in
    ``folder`` first) and ``args``."""
    policy = bench.sessions_policy()
    if isinstance(policy, dict):
        path = folder / "policy.json"
        path.write_text(json.dumps(policy))
        policy = str(path)
    return start_server(bench.model, folder, "--policy", policy, *args)


def run(bench: ServeBench, base_url: str | None = None, key: str | None = None, log=print) -> dict:
    """Every level against a server started per ``bench.batches`` value (or against ``base_url``), side by side
    in one run; each row says its batch setting, and ``speedup`` is its tokens/s over the unbatched row's."""
    rows, per_turn = [], {}
    servers = [(None, False)] if base_url else [(b, p) for p in bench.packed for b in bench.batches]
    for server in servers:
        got, turns = _one_server(bench, server, base_url, key, log)
        rows += got
        per_turn.update(turns)
    # the baseline: one turn at a time, unpacked when that ran (the default server), else packed
    serial = {}
    for r in sorted(rows, key=lambda r: r["packed"], reverse=True):
        if r["batch"] == 0:
            serial[r["clients"]] = r
    for r in rows:
        base = serial.get(r["clients"], {})
        for key, ratio in (("tokens_per_s", "speedup"), ("decode_tokens_per_s", "decode_speedup")):
            r[ratio] = round(r[key] / base[key], 2) if base.get(key) and r[key] else None
    return {"benchmark": "serve", "model": bench.model, "turns_per_client": bench.turns, "max_tokens": bench.max_tokens,
            "max_queue": bench.max_queue, "policy": bench.sessions_policy(),
            "packed": list(bench.packed), "document_tokens": bench.document_tokens,
            "levels": rows, "turns": per_turn}


def _one_server(bench: ServeBench, server: tuple[int | None, bool], base_url: str | None, key: str | None,
                log) -> tuple[list[dict], dict]:
    batch, packed = server
    proc, folder = None, Path(tempfile.mkdtemp(prefix="snapkv-bench-serve-"))
    url = base_url
    if url is None:
        proc, url = launch(bench, folder, "--max-queue", str(bench.max_queue), "--batch", str(batch),
                           *(["--packed-weights"] if packed else []))
    rows, per_turn = [], {}
    try:
        stream_turn(url, bench.model, [{"role": "user", "content": "Warm up."}], 4, -1, 0, key)  # load, first forward
        for n in bench.levels:
            row = {"batch": batch, "packed": packed,
                   **run_clients(url, bench.model, n, bench, key)}
            per_turn[f"batch={batch},packed={packed},N={n}"] = row.pop("per_turn")
            log(f"batch={batch} packed={packed} N={n}: {row['tokens_per_s']} tok/s, TTFT p50 {row['ttft_ms_p50']} ms, "
                f"TPOT p50/p95 {row['tpot_ms_p50']}/{row['tpot_ms_p95']} ms, 429s {row['status_429']}, "
                f"errors {row['errors']}")
            rows.append(row)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return rows, per_turn


def table(result: dict) -> str:
    head = (f"{'batch':>5} {'packed':>6} {'N':>3} {'turns':>5} {'tok/s':>7} {'x':>5} {'decode/s':>8} {'x':>5} "
            f"{'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'TPOT p95':>9} {'429':>4} {'errors':>6}")
    lines = [head, "-" * len(head)]
    for r in result["levels"]:
        lines.append(f"{r['batch']!s:>5} {'yes' if r['packed'] else 'no':>6} {r['clients']:>3} {r['turns']:>5} "
                     f"{r['tokens_per_s']!s:>7} {r['speedup']!s:>5} {r['decode_tokens_per_s']!s:>8} "
                     f"{r['decode_speedup']!s:>5} "
                     f"{r['ttft_ms_p50']!s:>9} {r['ttft_ms_p95']!s:>9} {r['tpot_ms_p50']!s:>9} "
                     f"{r['tpot_ms_p95']!s:>9} {r['status_429']:>4} {r['errors']:>6}")
    return "\n".join(lines)
