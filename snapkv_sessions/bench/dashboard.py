"""``bench dashboard``: the Grafana dashboard's panels drawn from a live server's scrapes.

Grafana and Prometheus are not part of this project, so this module stands in for both, just far enough to draw
``deploy/grafana/snapkv-sessions.json`` as an operator would see it: a server runs a known workload
(:mod:`.serve`'s streaming clients), ``GET /metrics`` is scraped every ``interval`` seconds, and every panel's
PromQL is evaluated over the scrapes by :func:`evaluate`, a small evaluator of the subset of PromQL the dashboard
uses (``rate``, ``sum`` / ``sum by``, ``histogram_quantile``, arithmetic between vectors and numbers, label
matchers). The picture goes to docs/; the JSON says, per panel and query, how many scrapes gave it a value, so a
panel that stays empty under a real workload shows as such.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..errors import ConfigError

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "snapkv-sessions.json"

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
Vector = dict[Labels, float]


@dataclass(frozen=True)
class Scrape:
    """One ``GET /metrics``: when (seconds since the first) and every sample, (name, labels) -> value."""

    t: float
    samples: dict[tuple[str, Labels], float]

    @classmethod
    def parse(cls, t: float, text: str) -> Scrape:
        return cls(t, {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(text) for s in family.samples})

    @classmethod
    def fetch(cls, url: str, key: str | None, t0: float, timeout: float = 10.0) -> Scrape:
        """``GET url`` (a ``/metrics``) now, timed from ``t0`` (``time.monotonic``); a server that does not answer
        200 is a clear error naming the URL."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            res = httpx.get(url, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ConfigError("url", url[:200], f"no answer ({type(exc).__name__}); is the server running?") from None
        if res.status_code != 200:
            raise ConfigError("url", url[:200], f"answered {res.status_code} ({res.text[:200]})")
        return cls.parse(time.monotonic() - t0, res.text)


# ---------------------------------------------------------------------- the PromQL subset

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>\"(?:[^\"\\]|\\.)*\")|(?P<op>=~|!~|!=|[-+*/(){}\[\],=])"
                    r"|(?P<name>[A-Za-z_$][A-Za-z0-9_:$]*))")


def _tokens(expr: str) -> list[str]:
    out, at = [], 0
    while at < len(expr):
        m = _TOKEN.match(expr, at)
        if m is None or m.end() == at:
            if expr[at:].strip() == "":
                break
            raise ConfigError("expr", expr[:200], f"cannot read it at {expr[at:at + 20]!r}")
        out.append(m.group().strip())
        at = m.end()
    return [t for t in out if t]


class _Parser:
    """expr := term (('+' | '-' | '*' | '/') term)*, left to right (the dashboard writes no precedence that
    matters: ``1 - a / b`` is parsed as ``1 - (a / b)`` by giving ``*`` and ``/`` their usual precedence)."""

    def __init__(self, expr: str) -> None:
        self.expr, self.toks, self.i = expr, _tokens(expr), 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ConfigError("expr", self.expr[:200], f"expected {want or 'more'} at token {self.i} ({tok!r})")
        self.i += 1
        return tok

    def parse(self):
        node = self.sum_()
        if self.peek() is not None:
            raise ConfigError("expr", self.expr[:200], f"unexpected {self.peek()!r}")
        return node

    def sum_(self):
        node = self.product()
        while self.peek() in ("+", "-"):
            node = ("bin", self.take(), node, self.product())
        return node

    def product(self):
        node = self.atom()
        while self.peek() in ("*", "/"):
            node = ("bin", self.take(), node, self.atom())
        return node

    def atom(self):
        tok = self.take()
        if tok == "(":
            node = self.sum_()
            self.take(")")
            return node
        if re.fullmatch(r"\d+(?:\.\d+)?", tok):
            return ("num", float(tok))
        if tok == "sum":
            by = []
            if self.peek() == "by":
                self.take("by")
                self.take("(")
                while self.peek() != ")":
                    tok = self.take()
                    if tok != ",":
                        by.append(tok)
                self.take(")")
            self.take("(")
            inner = self.sum_()
            self.take(")")
            return ("sum", tuple(by), inner)
        if tok == "rate":
            self.take("(")
            sel = self.selector(self.take())
            self.take("[")
            while self.take() != "]":
                pass
            self.take(")")
            return ("rate", sel)
        if tok == "histogram_quantile":
            self.take("(")
            q = float(self.take())
            self.take(",")
            inner = self.sum_()
            self.take(")")
            return ("quantile", q, inner)
        return ("vector", self.selector(tok))

    def selector(self, name: str):
        matchers = []
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), json.loads(self.take())
                matchers.append((label, op, value))
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
        return name, tuple(matchers)


def _matches(labels: Labels, matchers, variables: dict[str, str]) -> bool:
    have = dict(labels)
    for label, op, value in matchers:
        for var, sub in variables.items():
            value = value.replace(f"${var}", sub)
        got = have.get(label, "")
        ok = {"=": got == value, "!=": got != value, "=~": re.fullmatch(value, got) is not None,
              "!~": re.fullmatch(value, got) is None}[op]
        if not ok:
            return False
    return True


def _instant(scrape: Scrape, selector, variables) -> Vector:
    name, matchers = selector
    return {labels: v for (n, labels), v in scrape.samples.items() if n == name and _matches(labels, matchers, variables)}


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over one series' cumulative (upper bound, count) buckets."""
    buckets = sorted(buckets)
    if len(buckets) < 2 or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return buckets[-2][0]


def evaluate(expr: str, scrapes: list[Scrape], at: int, window: int, variables: dict[str, str] | None = None,
             ) -> Vector | float:
    """``expr`` at scrape ``at``, ``rate`` over the ``window`` scrapes before it; a vector, or a number for an
    expression of numbers only. ``variables``: the dashboard's ($model_name -> a regex)."""
    variables = variables or {}

    def ev(node) -> Vector | float:
        kind = node[0]
        if kind == "num":
            return node[1]
        if kind == "vector":
            return _instant(scrapes[at], node[1], variables)
        if kind == "rate":
            start = max(at - window, 0)
            now, then = _instant(scrapes[at], node[1], variables), _instant(scrapes[start], node[1], variables)
            dt = scrapes[at].t - scrapes[start].t
            if dt <= 0:
                return {}
            # a counter that went down was reset (a restarted replica): it counts from 0
            return {k: (v - then.get(k, 0.0) if v >= then.get(k, 0.0) else v) / dt for k, v in now.items()}
        if kind == "sum":
            inner, out = ev(node[2]), {}
            if not isinstance(inner, dict):
                return inner
            for labels, v in inner.items():
                key = tuple((k, val) for k, val in labels if k in node[1])
                out[key] = out.get(key, 0.0) + v
            return out
        if kind == "quantile":
            inner, groups = ev(node[2]), {}
            for labels, v in inner.items():
                le = dict(labels).get("le")
                if le is None:
                    continue
                key = tuple((k, val) for k, val in labels if k != "le")
                groups.setdefault(key, []).append((float(le), v))
            return {k: _quantile(node[1], b) for k, b in groups.items()}
        op, left, right = node[1], ev(node[2]), ev(node[3])
        fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
              "/": lambda a, b: a / b if b else math.nan}[op]
        if not isinstance(left, dict) and not isinstance(right, dict):
            return fn(left, right)
        if not isinstance(left, dict):
            return {k: fn(left, v) for k, v in right.items()}
        if not isinstance(right, dict):
            return {k: fn(v, right) for k, v in left.items()}
        return {k: fn(v, right[k]) for k, v in left.items() if k in right}

    return ev(_Parser(expr).parse())


# ---------------------------------------------------------------------- the run and the picture


def scrape_while(url: str, work, interval: float, key: str | None = None) -> list[Scrape]:
    """Scrape ``url``'s ``/metrics`` every ``interval`` seconds while ``work()`` runs on a thread, and twice
    after it ends (so the last rates see the end of the workload)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            failure.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    thread.start()
    scrapes, tail = [], 2
    while tail > 0:
        scrapes.append(Scrape.fetch(url, key, t0, timeout=30.0))
        if done.is_set():
            tail -= 1
        time.sleep(interval)
    thread.join()
    if failure:
        raise failure[0]
    return scrapes


def series(dashboard: dict, scrapes: list[Scrape], window: int) -> list[dict]:
    """Every chart panel's queries evaluated at every scrape: per panel, per target, per legend, the values."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.append({"title": panel["title"], "row": True, "gridPos": panel["gridPos"]})
            continue
        lines = []
        for target in panel["targets"]:
            per: dict[str, list[float]] = {}
            for i in range(len(scrapes)):
                value = evaluate(target["expr"], scrapes, i, window, {"model_name": ".*"})
                vec = value if isinstance(value, dict) else {(): value}
                for labels, v in vec.items():
                    name = _legend(target.get("legendFormat", ""), dict(labels))
                    per.setdefault(name, [math.nan] * len(scrapes))[i] = v
            lines.append({"expr": target["expr"], "lines": per,
                          "points": sum(any(not math.isnan(v[i]) for v in per.values()) for i in range(len(scrapes)))})
        out.append({"title": panel["title"], "unit": panel["fieldConfig"]["defaults"].get("unit", ""),
                    "gridPos": panel["gridPos"], "targets": lines})
    return out


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or ",".join(
        f"{k}={v}" for k, v in sorted(labels.items())) or "value"


def draw(panels: list[dict], times: list[float], path: str, title: str) -> None:
    """The panels on Grafana's 24-column grid, each a line chart of its series over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit = 0.42  # inches per grid row
    fig = plt.figure(figsize=(16, rows * unit + 0.6))
    fig.suptitle(title, fontsize=11, y=1 - 0.15 / (rows * unit + 0.6))
    for p in panels:
        g = p["gridPos"]
        left, width = g["x"] / 24 + 0.035, g["w"] / 24 - 0.05
        top = 1 - (g["y"] * unit + 0.5) / (rows * unit + 0.6)
        height = (g["h"] * unit) / (rows * unit + 0.6)
        if p.get("row"):
            fig.text(0.01, top - height / 2, p["title"], fontsize=11, weight="bold", va="center")
            continue
        ax = fig.add_axes((left, top - height + 0.012, width, height - 0.03))
        ax.set_title(p["title"], fontsize=8, loc="left")
        for target in p["targets"]:
            for name, values in target["lines"].items():
                if any(not math.isnan(v) for v in values):
                    ax.plot(times, values, label=name[:30], linewidth=1.0)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.tick_params(labelsize=6)
        ax.set_ylabel(p["unit"], fontsize=6)
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=70)
    plt.close(fig)


def summary(panels: list[dict], scrapes: int) -> list[dict]:
    """Per chart panel: its queries and how many of the scrapes gave each a value."""
    return [{"panel": p["title"], "queries": [{"expr": t["expr"], "scrapes_with_data": t["points"]}
                                               for t in p["targets"]], "scrapes": scrapes}
            for p in panels if not p.get("row")]


def table(result: dict) -> str:
    lines = [f"{len(result['panels'])} panels over {result['scrapes']} scrapes ({result['seconds']} s); "
             f"picture: {result['plot']}", ""]
    for p in result["panels"]:
        counts = "/".join(str(q["scrapes_with_data"]) for q in p["queries"])
        lines.append(f"{p['panel'][:58]:<58} scrapes with data: {counts}")
    return "\n".join(lines)


DASHBOARD_POLICY = {
    "name": "dashboard",
    "compression": {"budget_ratio": 0.3, "window": 16, "pin_overflow": "grow"},
    "drift": {"embedder": "none"},
    # the tier with decode-time recall, and a pool cap small enough that some tiers are dropped (re-prefills)
    "memory": {"cold": True, "max_bytes": 40 << 20, "recall": {"ratio": 0.1, "selector": "lowrank", "reduce": "mass"}},
}


def run(model: str, clients: list[int], turns: int, max_tokens: int, document_tokens: int, batch: int,
        interval: float, window: int, plot: str | None, log=print) -> dict:
    """A server of ``model`` (under :data:`DASHBOARD_POLICY`) runs bench serve's clients at each of ``clients``
    concurrent sessions in turn while its ``/metrics`` is scraped; every dashboard panel evaluated over the
    scrapes, drawn to ``plot``."""
    import tempfile

    from . import serve as serve_bench

    if interval <= 0 or window < 1:
        raise ConfigError("interval", interval, "must be > 0 seconds, with a window of at least 1 scrape")
    dashboard = json.loads(DASHBOARD.read_text())
    folder = Path(tempfile.mkdtemp(prefix="snapkv-bench-dashboard-"))
    (folder / "policy.json").write_text(json.dumps(DASHBOARD_POLICY))
    proc, url = serve_bench.start_server(model, folder, "--policy", str(folder / "policy.json"), "--batch",
                                         str(batch), "--max-tokens", str(max_tokens))
    bench = serve_bench.ServeBench(model, clients, turns, max_tokens, document_tokens=document_tokens)
    served = serve_bench.served_model(url)
    levels = []

    def work() -> None:
        for n in clients:
            lv = serve_bench.run_clients(url, served, n, bench, None)
            log(f"N={n}: {lv.turns} turns, {lv.tokens_per_s} tok/s, errors {lv.errors}")
            levels.append({"clients": n, "turns": lv.turns, "tokens_per_s": lv.tokens_per_s, "errors": lv.errors})

    t0 = time.monotonic()
    try:
        scrapes = scrape_while(url.removesuffix("/v1") + "/metrics", work, interval)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    panels = series(dashboard, scrapes, window)
    if plot:
        draw(panels, [s.t for s in scrapes], plot, f"snapkv-sessions dashboard: {model}, bench serve clients "
             f"{','.join(map(str, clients))} x {turns} turns, scraped every {interval:g} s (rendered from "
             f"deploy/grafana/snapkv-sessions.json's queries)")
    return {"benchmark": "dashboard", "model": model, "policy": DASHBOARD_POLICY, "clients": clients, "turns": turns,
            "document_tokens": document_tokens, "batch": batch, "interval_s": interval, "rate_window_scrapes": window,
            "scrapes": len(scrapes), "seconds": round(time.monotonic() - t0, 1), "levels": levels, "plot": plot,
            "panels": summary(panels, len(scrapes))}
