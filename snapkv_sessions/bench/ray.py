"""``bench ray``: the Ray Serve application against the single-process server, and the cost of a session's rebuild.

1. **Routing overhead.** The same N concurrent multi-turn clients (``bench serve``'s) run against the Ray ingress
   (a local Ray on 127.0.0.1, ``replicas`` engine replicas) and against ``snapkv-sessions serve`` in one process,
   with the same model, policy, batch and store, one after the other in one run.
2. **Rebuild.** A session arriving at a replica without its cache (its replica died, or it was evicted) is rebuilt
   from the store by replaying its recorded turns. For every session of the Ray run, the time of
   :meth:`Session.open` on a fresh runner (what a new replica does) against the prefill time its turns took live.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from .serve import ServeBench, launch, run_clients, stream_turn


def run(bench: ServeBench, db: str, replicas: int, log=print) -> dict:
    """Both servers at every level of ``bench.levels``, then the rebuild of every session the Ray run made."""
    from ray import serve

    from ..serve.ray import RaySpec, build, free_port, start_local

    policy = bench.sessions_policy()
    batch = bench.batches[-1]
    port = free_port()
    start_local(port)
    spec = RaySpec(model=bench.model, db=db, policy=policy, replicas=replicas, batch=batch,
                   max_tokens=bench.max_tokens)
    serve.run(build(spec), name="snapkv-bench", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1"
    rows = []
    try:
        rows += _levels(url, bench, f"ray ({replicas} replica{'s' * (replicas > 1)})", log)
    finally:
        serve.shutdown()
    proc, url = launch(bench, Path(tempfile.mkdtemp(prefix="snapkv-bench-ray-")), "--batch", str(batch), "--db", db)
    try:
        rows += _levels(url, bench, "one process", log)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    single = {r["clients"]: r for r in rows if r["server"] == "one process"}
    for r in rows:
        base = single.get(r["clients"], {}).get("tokens_per_s")
        r["vs_one_process"] = round(r["tokens_per_s"] / base, 3) if base and r["tokens_per_s"] else None
    return {"benchmark": "ray", "model": bench.model, "replicas": replicas, "batch": batch, "policy": policy,
            "turns_per_client": bench.turns, "max_tokens": bench.max_tokens, "levels": rows,
            "rebuild": rebuild(db, bench.model, [r for r in rows if r["server"].startswith("ray")], log)}


def _levels(url: str, bench: ServeBench, server: str, log) -> list[dict]:
    stream_turn(url, bench.model, [{"role": "user", "content": "Warm up."}], 4, -1, 0, None)
    rows = []
    for n in bench.levels:
        level = run_clients(url, bench.model, n, bench, None)
        row = {"server": server, **level.to_json()}
        row["sessions"] = sorted({t.session_id for t in level.per_turn if t.session_id})
        log(f"{server} N={n}: {row['tokens_per_s']} tok/s, TTFT p50 {row['ttft_ms_p50']} ms, "
            f"TPOT p50 {row['tpot_ms_p50']} ms, errors {row['errors']}")
        rows.append(row)
    return rows


def rebuild(db: str, model: str, rows: list[dict], log) -> dict:
    """Per session: seconds to open it on a fresh runner (replay of its recorded turns) and the prefill seconds its
    turns took live; the median of their ratio."""
    from ..models import load_model
    from ..runner import ModelRunner
    from ..session import Session
    from ..store import SessionStore

    store = SessionStore(db)
    runner = ModelRunner(*load_model(model))
    measured = []
    for sid in sorted({s for r in rows for s in r["sessions"]}):
        live = sum((t["timings"] or {}).get("prefill_ms", 0.0) for t in store.turns(sid, status="done")) / 1e3
        t0 = time.perf_counter()
        Session.open(sid, model=runner, store=store)
        measured.append({"session": sid, "rebuild_s": round(time.perf_counter() - t0, 3), "prefill_s": round(live, 3),
                         "turns": len(store.turns(sid, status="done"))})
    ratios = [m["rebuild_s"] / m["prefill_s"] for m in measured if m["prefill_s"]]
    summary = {"sessions": len(measured), "rebuild_s_median": _median([m["rebuild_s"] for m in measured]),
               "prefill_s_median": _median([m["prefill_s"] for m in measured]),
               "ratio_median": round(statistics.median(ratios), 3) if ratios else None, "per_session": measured}
    log(f"rebuild: {summary['sessions']} sessions, median {summary['rebuild_s_median']} s against "
        f"{summary['prefill_s_median']} s of live prefill (ratio {summary['ratio_median']})")
    return summary


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def table(result: dict) -> str:
    head = f"{'server':<18} {'N':>3} {'turns':>5} {'tok/s':>7} {'x':>6} {'TTFT p50':>9} {'TPOT p50':>9} {'errors':>6}"
    lines = [head, "-" * len(head)]
    for r in result["levels"]:
        lines.append(f"{r['server']:<18} {r['clients']:>3} {r['turns']:>5} {r['tokens_per_s']!s:>7} "
                     f"{r['vs_one_process']!s:>6} {r['ttft_ms_p50']!s:>9} {r['tpot_ms_p50']!s:>9} {r['errors']:>6}")
    rb = result["rebuild"]
    lines.append(f"rebuild from the store: median {rb['rebuild_s_median']} s per session against "
                 f"{rb['prefill_s_median']} s of live prefill (median ratio {rb['ratio_median']}, "
                 f"{rb['sessions']} sessions)")
    return "\n".join(lines)
