"""``bench serve``: N concurrent clients against ``snapkv-sessions serve``, each a multi-turn session, and the same
workload against any other OpenAI-compatible server (``--against``: vLLM, SGLang, llama.cpp's server) in one run.

Every client streams its turns through the OpenAI wire format (SSE, ``stream_options.include_usage``, greedy:
``temperature`` 0) and sends the whole conversation each time, as agent frameworks do: each server's own replies
become the assistant messages of its next requests, so the requests are identical across servers up to those
replies and the ``model`` field. Per turn: time to the first content token (TTFT), time per output token after it
(TPOT), completion tokens (the server's ``usage``); per level of concurrency: aggregate completion tokens per
second over the wall time, aggregate decode tokens per second (:func:`decode_rate`), p50/p95 of TTFT and TPOT,
the p50 TTFT of first and of later turns, the p50 of each stream's own decode rate, the server's RSS (our server's
process tree, or ``--against-pid``'s), 429s and other errors.

Our servers (one per ``batches`` value, packed setting and budget) run one after another, each in a subprocess on
a free loopback port with a private SQLite store, unless ``base_url`` names a running one; then every other server,
one after another. Every row's ``speedup`` is to our one-turn-at-a-time server's at the same budget and N, and
``ratios`` holds each of our servers over each other one (ours / theirs).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx

from ..errors import ConfigError, SnapKVError

QUESTIONS = ["Name three rivers in Europe.", "Which of them is the longest?", "Write one sentence about it.",
             "Now name a river in Asia.", "Compare the two in one sentence."]
LOOPBACK = ("127.0.0.1", "::1", "localhost")
FULL_BUDGET = 32768  # tokens per layer: more than any context the bundled models take, so nothing is evicted
NEVER = 1 << 30  # min_prompt_tokens of the full budget: no context is that long, so nothing observes or compresses

Budget = int | float | str  # a token budget, a budget ratio in (0, 1], "full", or "policy" (the policy's own)


class EndpointError(SnapKVError, RuntimeError):
    """An OpenAI-compatible server did not answer as one (down, or its ``GET /models`` names no model)."""


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
    session_id: str | None = None  # the session that served the turn (our server's extension field)
    error: str | None = None  # a refused request: the start of the server's error body
    reply: str = ""  # the reply's text: compared across servers (:class:`Agreement`)


@dataclass
class Level:
    """One level of concurrency against one server: what its clients measured."""

    clients: int
    turns: int
    wall_s: float
    completion_tokens: int
    tokens_per_s: float | None
    decode_tokens_per_s: float | None  # aggregate, over the time some turn was decoding (decode_rate)
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    tpot_ms_p50: float | None
    tpot_ms_p95: float | None
    ttft_first_ms_p50: float | None  # the clients' first turns (the document, when there is one)
    ttft_later_ms_p50: float | None  # their later turns
    stream_decode_tokens_per_s: float | None  # p50 over turns of a turn's own (tokens - 1) / (last - first piece)
    status_429: int
    errors: int
    error_samples: list[str]
    per_turn: list[TurnTiming] = field(repr=False)
    rss_bytes: int | None = None  # the server's, read once the level ended
    # a server of ours with GET /metrics (started by the run or given by --against): the mean seconds of a decode
    # step's forward and rows per step over the level, as its scheduler timed them; beside TPOT, what the server
    # adds to each token over its batched step
    step_ms_mean: float | None = None
    step_rows_mean: float | None = None

    def to_json(self) -> dict:
        """The level's figures for the result JSON, without its per-turn records."""
        return {k: v for k, v in asdict(self).items() if k != "per_turn"}


@dataclass(frozen=True)
class Target:
    """One server a run measures: one of ours (started by the run, or ``base_url``) or another (``--against``)."""

    kind: Literal["ours", "against"]
    url: str | None = None  # None: ours, started by the run on a free loopback port
    model: str | None = None  # the model id its requests name (None: the bench's model)
    key: str | None = None
    pid: int | None = None  # the process whose tree's RSS is read (ours started by the run: filled in at launch)
    batch: int | None = None  # ours: decode slots
    packed: bool | None = None  # ours: packed linear weights (None: serve's default, packed where that is exact)
    budget: Budget | None = None  # ours: "full", a ratio, a token budget, or "policy"
    metrics: bool = True  # ours: GET /metrics and its sink (False: serve --no-metrics)

    @property
    def label(self) -> str:
        if self.kind == "against":
            return f"{self.url} ({self.model})"
        packed = "auto" if self.packed is None else self.packed
        parts = [f"batch={self.batch}", f"packed={packed}", *([] if self.metrics else ["metrics=off"])]
        return "ours " + ",".join([*parts, f"budget={self.budget}"] if self.budget is not None else parts)


@dataclass
class ServerRun:
    """Every level against one server, and its summary: the level with the fewest clients (``at_clients``) gives
    the first- and later-turn TTFT and the single-stream decode rate; RSS is the largest read after a level."""

    target: Target
    levels: list[Level]

    @property
    def summary_level(self) -> Level | None:
        return min(self.levels, key=lambda lv: lv.clients) if self.levels else None

    @property
    def rss_bytes(self) -> int | None:
        seen = [lv.rss_bytes for lv in self.levels if lv.rss_bytes is not None]
        return max(seen) if seen else None

    def to_json(self) -> dict:
        lv = self.summary_level
        return {"server": self.target.label, "kind": self.target.kind, "url": self.target.url,
                "model": self.target.model, "batch": self.target.batch, "packed": self.target.packed,
                "metrics": self.target.metrics,
                "budget": self.target.budget, "at_clients": lv.clients if lv else None,
                "ttft_first_ms_p50": lv.ttft_first_ms_p50 if lv else None,
                "ttft_later_ms_p50": lv.ttft_later_ms_p50 if lv else None,
                "stream_decode_tokens_per_s": lv.stream_decode_tokens_per_s if lv else None,
                "tokens_per_s": {str(x.clients): x.tokens_per_s for x in self.levels},
                "rss_bytes": self.rss_bytes}


@dataclass(frozen=True)
class Ratios:
    """One of our servers over another server (ours / theirs): below 1 is better for the TTFTs and RSS, above 1
    for the rates."""

    ours: str
    theirs: str
    ttft_first: float | None
    ttft_later: float | None
    stream_decode: float | None
    tokens_per_s: dict[str, float | None]  # per N (as a string: JSON's keys)
    decode_tokens_per_s: dict[str, float | None]
    rss: float | None

    @classmethod
    def of(cls, ours: ServerRun, theirs: ServerRun) -> Ratios:
        a, b = ours.summary_level, theirs.summary_level
        by_n = {lv.clients: lv for lv in theirs.levels}

        def per_n(name: str) -> dict[str, float | None]:
            return {str(lv.clients): _ratio(getattr(lv, name), getattr(by_n.get(lv.clients), name, None))
                    for lv in ours.levels}

        return cls(ours.target.label, theirs.target.label,
                   _ratio(a and a.ttft_first_ms_p50, b and b.ttft_first_ms_p50),
                   _ratio(a and a.ttft_later_ms_p50, b and b.ttft_later_ms_p50),
                   _ratio(a and a.stream_decode_tokens_per_s, b and b.stream_decode_tokens_per_s),
                   per_n("tokens_per_s"), per_n("decode_tokens_per_s"), _ratio(ours.rss_bytes, theirs.rss_bytes))


@dataclass(frozen=True)
class Agreement:
    """How often a server's replies equal the reference server's (our full cache's), turn by turn at one N.

    The clients are deterministic (greedy, the same questions), so the same client's same turn is the same request
    on both servers until some reply differs: from then on that conversation's prompts differ too, and its later
    turns are still compared but no longer judge the compression alone. ``first_equal`` counts the conversations
    whose first turn (the document) agrees; ``conversations_equal`` those equal on every turn."""

    server: str
    reference: str
    clients: int
    equal: int  # turns whose reply text equals the reference's
    compared: int  # turns both servers answered
    first_equal: int
    conversations_equal: int
    conversations: int

    @classmethod
    def of(cls, run: ServerRun, ref: ServerRun) -> list[Agreement]:
        out = []
        theirs = {lv.clients: lv for lv in ref.levels}
        for lv in run.levels:
            if lv.clients not in theirs:
                continue
            a = {(t.client, t.turn): t.reply for t in lv.per_turn if t.status == 200}
            b = {(t.client, t.turn): t.reply for t in theirs[lv.clients].per_turn if t.status == 200}
            both = sorted(a.keys() & b.keys())
            same = {k for k in both if a[k] == b[k]}
            clients = sorted({c for c, _ in both})
            whole = [c for c in clients if all(k in same for k in both if k[0] == c)]
            out.append(cls(run.target.label, ref.target.label, lv.clients, len(same), len(both),
                           sum((c, 1) in same for c in clients), len(whole), len(clients)))
        return out


def agreements(runs: list[ServerRun]) -> list[Agreement]:
    """Every server's replies against our first full-cache server's (none: no reference, no rows)."""
    ref = next((r for r in runs if r.target.kind == "ours" and r.target.budget == "full"), None)
    return [] if ref is None else [a for r in runs if r is not ref for a in Agreement.of(r, ref)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def check_url(url: str, allow_remote: bool = False, param: str = "url") -> str:
    """A server's base URL (``http://host:port/v1``, no trailing slash; a trailing ``/chat/completions`` is
    dropped). A host other than 127.0.0.1, ::1 or localhost is refused unless ``allow_remote``: a benchmark's
    prompts should not leave the machine by a typo."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(param, url, "give the server's base URL, e.g. http://127.0.0.1:8000/v1")
    if parts.hostname not in LOOPBACK and not allow_remote:
        raise ConfigError(param, url, f"host {parts.hostname[:80]!r} is not a loopback address (127.0.0.1, ::1, "
                                      "localhost): the prompts would leave this machine; pass --allow-remote to mean it")
    base = url.strip().rstrip("/")
    return base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base


def served_model(url: str, api_key: str | None = None, hint: str = "give --model") -> str:
    """The first model id of the server's ``GET /models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        res = httpx.get(f"{url}/models", headers=headers, timeout=30)
        res.raise_for_status()
        return res.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise EndpointError(f"url={url[:200]!r}: GET /models gave no model id ({exc.__class__.__name__}: "
                            f"{str(exc)[:200]}); {hint}") from None


STEP_SERIES = ("snapkv:decode_step_seconds_sum", "snapkv:decode_step_seconds_count", "snapkv:decode_batch_size_sum")


def step_totals(url: str, key: str | None = None) -> tuple[float, ...] | None:
    """The server's running totals of :data:`STEP_SERIES` (summed over its model labels) from ``GET /metrics`` at
    the root of ``url`` (its ``/v1`` left off), read as the dashboard bench reads it (:class:`.dashboard.Scrape`);
    None when it has no such endpoint or series (another server, or ours with ``--no-metrics``)."""
    from .dashboard import Scrape

    try:
        scrape = Scrape.fetch(url.removesuffix("/").removesuffix("/v1") + "/metrics", key, time.monotonic())
    except (ConfigError, ValueError):  # no answer, not 200, or not Prometheus text
        return None
    totals = dict.fromkeys(STEP_SERIES, 0.0)
    seen = False
    for (name, _labels), value in scrape.samples.items():
        if name in totals:
            totals[name] += value
            seen = True
    return tuple(totals[k] for k in STEP_SERIES) if seen else None


def step_figures(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> tuple[float | None, float | None]:
    """(mean ms per decode step, mean rows per step) between two :func:`step_totals` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None, None
    steps = after[1] - before[1]
    return round(1e3 * (after[0] - before[0]) / steps, 1), round((after[2] - before[2]) / steps, 2)


def tree_rss_bytes(pid: int) -> int | None:
    """The summed VmRSS of a process and all its descendants (Linux ``/proc``; pages shared between them count
    once per process), or None when the process is gone or ``/proc`` cannot be read."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    root = _vm_rss(pid)
    if root is None:
        return None
    total, todo, seen = root, list(children.get(pid, [])), {pid}
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _vm_rss(p) or 0
        todo += children.get(p, [])
    return total


def _vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return 0  # a zombie: no memory left


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


def request_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """The body of every request a bench client sends, to any server: streamed with usage, greedy."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def stream_turn(url: str, model: str, messages: list[dict], max_tokens: int, client: int, turn: int,
                key: str | None) -> tuple[TurnTiming, str]:
    """One streamed request; its timing and the reply text."""
    body = request_body(model, messages, max_tokens)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0, first, last, text, usage, session_id = time.perf_counter(), None, None, [], {}, None
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=1800) as res:
        if res.status_code != 200:
            text = res.read().decode(errors="replace")
            return TurnTiming(client, turn, res.status_code, None, None, 0, 0, error=f"{res.status_code}: {text[:200]}"), ""
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
    reply = "".join(text)
    return TurnTiming(client, turn, 200, ttft, tpot, n, usage.get("prompt_tokens", 0), span, session_id,
                      reply=reply), reply


def document(client: int, tokens: int) -> str:
    """A made-up record list of about ``tokens`` tokens (about four characters per token), different per client."""
    lines, size, i = [], 0, 0
    while size < tokens * 4:
        line = f"Record {i}: the river R{client}-{i} is {(i * 37 + client * 11) % 900 + 100} km long."
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(lines)


def run_clients(url: str, model: str, clients: int, bench: ServeBench, key: str | None) -> Level:
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
                if timing.error is not None and timing.status != 429:
                    errors.append(timing.error)
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
    rates = [(t.completion_tokens - 1) / (t.decoding[1] - t.decoding[0]) for t in ok
             if t.decoding is not None and t.decoding[1] > t.decoding[0]]
    tokens = sum(t.completion_tokens for t in ok)
    return Level(clients, len(ok), round(wall, 2), tokens, round(tokens / wall, 2) if wall else None, decode_rate(ok),
                 _pct(ttft, 50), _pct(ttft, 95), _pct(tpot, 50), _pct(tpot, 95),
                 _pct([t.ttft_ms for t in ok if t.turn == 1 and t.ttft_ms is not None], 50),
                 _pct([t.ttft_ms for t in ok if t.turn > 1 and t.ttft_ms is not None], 50),
                 _pct(rates, 50, 2), sum(t.status == 429 for t in timings),
                 len(errors), errors[:3], timings)


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


def _pct(values: list[float], q: int, digits: int = 1) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], digits)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], digits)


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
    packed: tuple[bool | None, ...] = (None,)  # servers with and/or without packed linear weights (None: serve's default)
    metrics: tuple[bool, ...] = (True,)  # servers with and/or without GET /metrics (serve --no-metrics)
    document_tokens: int = 0  # each client's first message starts with a document of about this many tokens
    budgets: tuple[float | str, ...] = ()  # one server per value: "full" or a budget ratio; (): ``budget``/``policy``
    against: tuple[Target, ...] = ()  # other OpenAI-compatible servers, run after ours with the same workload
    ours: bool = True  # False: only the ``against`` servers

    def sessions_policy(self, budget: float | str | None = None) -> str | dict:
        """The servers' policy: ``policy`` when given, else ``budget`` with a 16-token window; with ``budget``
        (one of ``budgets``), that policy with its compression budget replaced: ``"full"`` keeps every token and
        never compresses (nor runs drift or the tier), a ratio is ``compression.budget_ratio`` (with
        ``pin_overflow: grow``: a short turn's share may be smaller than its pins)."""
        if budget is None:
            return self.policy or {"compression": {"budget": self.budget, "window": 16}}
        from ..policy import Policy

        base = Policy.load(self.policy).model_dump(mode="json") if self.policy else {"compression": {"window": 16}}
        comp = {**base["compression"], "budget": None, "budget_ratio": None}
        if budget == "full":
            data = {**base, "name": "full", "compression": {**comp, "budget": FULL_BUDGET}, "min_prompt_tokens": NEVER,
                    "drift": {**base.get("drift", {}), "embedder": "none"},
                    "memory": {**(base.get("memory") or {}), "cold": False}}
        else:
            # a short turn's share can be smaller than its pins: the budget grows to them (as rag-qa's does)
            data = {**base, "name": f"ratio-{budget}",
                    "compression": {**comp, "budget_ratio": float(budget), "pin_overflow": "grow"}}
        return Policy.from_dict(data).model_dump(mode="json")  # checked here, before any server starts

    def budget_label(self) -> Budget:
        return "policy" if self.policy else self.budget


def launch(bench: ServeBench, folder: Path, *args: str, budget: float | str | None = None) -> tuple[subprocess.Popen, str]:
    """:func:`start_server` with the bench's model and policy (at ``budget``, one of ``bench.budgets``; a policy
    given as a mapping is written to a file in ``folder`` first) and ``args``."""
    policy = bench.sessions_policy(budget)
    if isinstance(policy, dict):
        path = folder / "policy.json"
        path.write_text(json.dumps(policy))
        policy = str(path)
    return start_server(bench.model, folder, "--policy", policy, *args)


def against_targets(urls: list[str], models: list[str], pids: list[int], key: str | None,
                    allow_remote: bool = False) -> tuple[Target, ...]:
    """The ``--against`` servers: each URL checked (loopback unless ``allow_remote``) and asked for its model id
    unless ``models`` gives it (by position, as ``pids`` gives the process whose RSS is read). A server that does
    not answer is an :class:`EndpointError` before anything runs."""
    if len(models) > len(urls) or len(pids) > len(urls):
        raise ConfigError("against", urls, f"{len(models)} --against-model and {len(pids)} --against-pid values "
                                           f"for {len(urls)} --against servers: give at most one each per server")
    out = []
    for i, raw in enumerate(urls):
        url = check_url(raw, allow_remote, param="against")
        hint = f"is the server at --against {url[:200]} running? (or give --against-model)"
        if i < len(models) and models[i]:
            model = models[i]
            try:  # it must answer; a server without GET /models is fine when the model id is given
                httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
            except httpx.HTTPError as exc:
                raise EndpointError(f"against={url[:200]!r}: no answer ({type(exc).__name__}: {str(exc)[:200]}); "
                                    f"is that server running?") from None
        else:
            model = served_model(url, key, hint=hint)
        out.append(Target("against", url, model, key, pids[i] if i < len(pids) else None))
    return tuple(out)


def run(bench: ServeBench, base_url: str | None = None, key: str | None = None, log=print) -> dict:
    """Every level against each of our servers (one per ``bench.batches`` value, packed setting and budget, or
    ``base_url``), then against each ``bench.against`` server, side by side in one run."""
    budgets = bench.budgets or (None,)
    ours = [] if not bench.ours else [Target("ours", base_url, bench.model, key)] if base_url else [
        Target("ours", batch=b, packed=p, budget=bench.budget_label() if x is None else x, metrics=m)
        for x in budgets for p in bench.packed for b in bench.batches for m in bench.metrics]
    runs = [_one_server(bench, t, log) for t in (*ours, *bench.against)]
    rows, per_turn = [], {}
    for r in runs:
        for lv in r.levels:
            rows.append({"server": r.target.label, "kind": r.target.kind, "batch": r.target.batch,
                         "packed": r.target.packed, "budget": r.target.budget, "metrics": r.target.metrics,
                         **lv.to_json()})
            per_turn[f"{r.target.label},N={lv.clients}"] = [asdict(t) for t in lv.per_turn]
    # the baseline: our server at one turn at a time and the same budget, unpacked when that ran, else packed
    serial = {}
    for r in sorted((r for r in rows if r["kind"] == "ours" and r["metrics"]), key=lambda r: bool(r["packed"]),
                    reverse=True):
        if r["batch"] == 0:
            serial[(r["budget"], r["clients"])] = r
    # with --metrics both: each server with metrics against the same server without (what the metrics cost)
    bare = {(r["budget"], r["batch"], r["packed"], r["clients"]): r for r in rows if r["kind"] == "ours"
            and not r["metrics"]}
    for r in rows:
        base = serial.get((r["budget"], r["clients"]), {}) if r["kind"] == "ours" else {}
        for name, ratio in (("tokens_per_s", "speedup"), ("decode_tokens_per_s", "decode_speedup")):
            r[ratio] = round(r[name] / base[name], 2) if base.get(name) and r[name] else None
        off = bare.get((r["budget"], r["batch"], r["packed"], r["clients"])) if r["kind"] == "ours" else None
        r["vs_no_metrics"] = (round(r["tokens_per_s"] / off["tokens_per_s"], 3)
                              if off and r["metrics"] and off["tokens_per_s"] and r["tokens_per_s"] else None)
    theirs = [r for r in runs if r.target.kind == "against"]
    ratios = [Ratios.of(a, b) for a in runs if a.target.kind == "ours" for b in theirs]
    return {"benchmark": "serve", "model": bench.model, "turns_per_client": bench.turns, "max_tokens": bench.max_tokens,
            "max_queue": bench.max_queue, "policy": bench.sessions_policy(),
            "budgets": list(bench.budgets), "packed": list(bench.packed), "document_tokens": bench.document_tokens,
            "servers": [r.to_json() for r in runs], "ratios": [asdict(x) for x in ratios],
            "agreement": [asdict(x) for x in agreements(runs)],
            "levels": rows, "turns": per_turn}


def _one_server(bench: ServeBench, target: Target, log) -> ServerRun:
    proc, url, model, pid = None, target.url, target.model or bench.model, target.pid
    if target.kind == "ours" and url is None:
        folder = Path(tempfile.mkdtemp(prefix="snapkv-bench-serve-"))
        proc, url = launch(bench, folder, "--max-queue", str(bench.max_queue), "--batch", str(target.batch),
                           *(["--packed-weights"] if target.packed else
                             ["--no-packed-weights"] if target.packed is False else []),
                           *([] if target.metrics else ["--no-metrics"]),
                           budget=None if not bench.budgets else target.budget)
        pid = proc.pid
    levels = []
    try:
        stream_turn(url, model, [{"role": "user", "content": "Warm up."}], 4, -1, 0, target.key)  # load, first forward
        for n in bench.levels:
            before = step_totals(url, target.key)  # ours, or another server of ours given by --against
            lv = run_clients(url, model, n, bench, target.key)
            lv.rss_bytes = tree_rss_bytes(pid) if pid else None
            lv.step_ms_mean, lv.step_rows_mean = step_figures(before, step_totals(url, target.key) if before else None)
            log(f"{target.label} N={n}: {lv.tokens_per_s} tok/s, TTFT p50 {lv.ttft_ms_p50} ms "
                f"(first/later turns {lv.ttft_first_ms_p50}/{lv.ttft_later_ms_p50}), TPOT p50/p95 "
                f"{lv.tpot_ms_p50}/{lv.tpot_ms_p95} ms (the server's step {lv.step_ms_mean} ms, {lv.step_rows_mean} rows), "
                f"429s {lv.status_429}, errors {lv.errors}")
            levels.append(lv)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{target.label[:240]}: {type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return ServerRun(target, levels)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def table(result: dict) -> str:
    head = (f"{'batch':>5} {'packed':>6} {'budget':>6} {'N':>3} {'turns':>5} {'tok/s':>7} {'x':>5} {'decode/s':>8} "
            f"{'x':>5} {'TTFT p50':>9} {'1st':>9} {'later':>9} {'TPOT p50':>9} {'TPOT p95':>9} {'step':>7} {'429':>4} "
            f"{'errors':>6}")
    lines = []
    for server in result.get("servers") or [{"server": None}]:
        if server["server"] is not None:
            lines += ["", f"{server['server']}: TTFT p50 first/later turns {server['ttft_first_ms_p50']}/"
                          f"{server['ttft_later_ms_p50']} ms, decode {server['stream_decode_tokens_per_s']} tok/s "
                          f"per stream (N={server['at_clients']}), RSS {_mib(server['rss_bytes'])} MiB"]
        lines += [head, "-" * len(head)]
        for r in result["levels"]:
            if server["server"] is not None and r.get("server") != server["server"]:
                continue
            c = {k: "-" if v is None else str(v) for k, v in r.items()}
            packed = "-" if r.get("kind") == "against" else {True: "yes", False: "no", None: "auto"}[r["packed"]]
            lines.append(f"{c['batch']:>5} {packed:>6} {c.get('budget', '-'):>6} "
                         f"{r['clients']:>3} {r['turns']:>5} {c['tokens_per_s']:>7} {c['speedup']:>5} "
                         f"{c['decode_tokens_per_s']:>8} {c['decode_speedup']:>5} {c['ttft_ms_p50']:>9} "
                         f"{c.get('ttft_first_ms_p50', '-'):>9} {c.get('ttft_later_ms_p50', '-'):>9} "
                         f"{c['tpot_ms_p50']:>9} {c['tpot_ms_p95']:>9} {c.get('step_ms_mean', '-'):>7} {r['status_429']:>4} "
                         f"{r['errors']:>6}")
    overhead = [r for r in result["levels"] if r.get("vs_no_metrics") is not None]
    if overhead:
        lines += ["", "with GET /metrics / without (tokens/s, side by side in this run):"]
        lines += [f"  {r['server']} N={r['clients']}: {r['vs_no_metrics']}" for r in overhead]
    if result.get("agreement"):
        lines += ["", f"replies equal to {result['agreement'][0]['reference']}'s, turn by turn (first turns; "
                      "whole conversations):"]
        lines += [f"  {x['server']} N={x['clients']}: {x['equal']}/{x['compared']} ({x['first_equal']}/"
                  f"{x['conversations']}; {x['conversations_equal']}/{x['conversations']})" for x in result["agreement"]]
    if result.get("ratios"):
        ns = sorted({n for x in result["ratios"] for n in x["tokens_per_s"]}, key=int)
        lines += ["", "ours / theirs: TTFT first, later turns, decode per stream, "
                      + ", ".join(f"tok/s N={n}" for n in ns) + ", RSS"]
        for x in result["ratios"]:
            lines.append(f"{x['ours']} / {x['theirs']}: {x['ttft_first']} {x['ttft_later']} {x['stream_decode']} "
                         + " ".join(str(x["tokens_per_s"].get(n)) for n in ns) + f" {x['rss']}")
    return "\n".join(lines).lstrip("\n")
