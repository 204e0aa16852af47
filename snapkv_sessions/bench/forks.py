"""``bench forks``: the same conversation sent N times at once, with and without kept turn boundaries.

One request continues the session; the others fork it. With boundaries kept (the default) a fork starts from a
copy of the session's cache at that turn boundary and prefills only its question; without (``serve
--no-fork-boundaries``) each fork prefills the whole history. Per mode, side by side in one run: the wall time of
the N requests, each fork's prefilled tokens and prefill time (from the turn records), how many forked from the
boundary, and whether every reply was the same.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .serve import document, start_server


def _one(model: str, requests: int, batch: int, document_tokens: int, boundaries: bool, folder: Path) -> dict:
    from ..store import SessionStore

    args = ["--batch", str(batch), "--max-tokens", "8", "--max-queue", str(max(16, requests))]
    proc, url = start_server(model, folder, *args, *([] if boundaries else ["--no-fork-boundaries"]))
    try:
        msgs = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": document(0, document_tokens) + "\nHow long is river R0-3?"}]
        first = httpx.post(f"{url}/chat/completions", json={"model": model, "messages": msgs}, timeout=600).json()
        msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And R0-7?"}]
        out: list[dict] = []

        def one() -> None:
            out.append(httpx.post(f"{url}/chat/completions", json={"model": model, "messages": msgs},
                                  timeout=600).json())

        threads = [threading.Thread(target=one) for _ in range(requests)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)
    store = SessionStore(f"sqlite:///{folder / 'sessions.db'}", must_exist=True)
    forks = []
    for reply in out:
        if reply["session_id"] == first["session_id"]:
            continue
        last = [t for t in store.turns(reply["session_id"]) if t["status"] == "done"][-1]
        forks.append({"prefill_tokens": len(last["prefill_tokens"]), "prefill_ms": last["timings"]["prefill_ms"],
                      "from_boundary": bool((store.get_session(reply["session_id"])["meta"] or {}).get("forked_from"))})
    return {"boundaries": boundaries, "requests": requests, "wall_s": round(wall, 2), "forks": len(forks),
            "from_boundary": sum(f["from_boundary"] for f in forks),
            "fork_prefill_tokens_median": statistics.median(f["prefill_tokens"] for f in forks) if forks else None,
            "fork_prefill_ms_median": round(statistics.median(f["prefill_ms"] for f in forks), 1) if forks else None,
            "same_reply": len({r["choices"][0]["message"]["content"] for r in out}) == 1}


def run(model: str, requests: int = 20, batch: int = 8, document_tokens: int = 1024,
        modes: tuple[bool, ...] = (False, True), log=print) -> dict:
    """Each mode (boundaries off, on) on a server of its own, one after the other; ``speedup``: wall time without
    over with."""
    rows = []
    for boundaries in modes:
        log(f"bench forks: {requests} identical requests, boundaries {'on' if boundaries else 'off'}")
        with tempfile.TemporaryDirectory(prefix="snapkv-bench-forks-") as tmp:
            rows.append(_one(model, requests, batch, document_tokens, boundaries, Path(tmp)))
    walls = {r["boundaries"]: r["wall_s"] for r in rows}
    speedup = round(walls[False] / walls[True], 2) if len(walls) == 2 and walls[True] else None
    return {"model": model, "batch": batch, "document_tokens": document_tokens, "rows": rows, "speedup": speedup}


def table(result: dict) -> str:
    lines = ["| boundaries | requests | wall s | forks (from boundary) | fork prefill tokens | fork prefill ms | "
             "same reply |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {'on' if r['boundaries'] else 'off'} | {r['requests']} | {r['wall_s']} | {r['forks']} "
                     f"({r['from_boundary']}) | {r['fork_prefill_tokens_median']} | {r['fork_prefill_ms_median']} | "
                     f"{r['same_reply']} |")
    if result["speedup"] is not None:
        lines.append(f"\nwall time without boundaries / with: {result['speedup']}x")
    return "\n".join(lines)
