"""The ``snapkv-sessions`` command line: a thin layer over the library; library errors become clean errors."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Mapping

import click

from .errors import SnapKVError


def clean_errors(fn):
    """Turn the library's own errors into a one-line CLI error (exit 1) instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SnapKVError as exc:
            raise click.ClickException(str(exc)) from None

    return wrapper


@click.group()
@click.version_option(package_name="snapkv-sessions")
def main() -> None:
    """Recoverable per-turn SnapKV sessions over a local Hugging Face causal LM."""


PLOT_INSTALL = "pip install matplotlib (or the extra: pip install 'snapkv-sessions[demo]')"


def need_matplotlib(plot_path: str | None) -> None:
    """``--plot`` draws with matplotlib, an optional dependency: say how to install it, and whether the PNG can be
    written where it is asked for, before any work is done (not as a traceback once the figure is drawn)."""
    if not plot_path:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.ClickException(f"--plot {plot_path}: matplotlib is not installed; {PLOT_INSTALL}") from None
    _check_writable("--plot", plot_path)


def _check_writable(option: str, path: str) -> None:
    """``path`` can be written as a file: its folder exists and is writable, and it is not itself a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        problem = "it is a folder; give a file name"
    elif not os.path.isdir(folder):
        problem = f"the folder {folder} does not exist"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f"the folder {folder} cannot be written"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        problem = "the file exists and cannot be written"
    else:
        return
    raise click.ClickException(f"{option} {path}: {problem}")


def quiet_loaders() -> None:
    """A CLI prints its own figures; the model loaders' progress bars only clutter them."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@main.command()
@click.option("--model", default=None, help="Model id, folder, GGUF or bundle.  [default: qwen2.5-coder-0.5b-instruct]")
@click.option("--policy", default="default", show_default=True, help="Policy name or YAML path.")
@click.option("--budget", default=160, show_default=True, help="Override: tokens kept per layer and KV head.")
@click.option("--window", default=16, show_default=True, help="Override: observation window.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap per turn.")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of text.")
@clean_errors
def demo(model, policy, budget, window, max_new_tokens, db, as_json) -> None:
    """Run a scripted multi-turn session: each question, its answer as it is decoded, and what the turn kept."""
    from .demo import DEFAULT_MODEL, demo_policy, run_demo

    quiet_loaders()
    for row in run_demo(model or DEFAULT_MODEL, demo_policy(policy, budget, window), db, max_new_tokens,
                        stream=not as_json):
        event = row.get("event")
        if as_json:
            if event != "question":
                click.echo(json.dumps(row))
        elif event == "session":
            click.echo(f"session {row['session_id']} on {row['model']} (policy {row['policy']}) "
                       f"stored in {row['store']}")
        elif event == "question":
            click.echo(f"\nturn {row['turn']} ({row['note']})\n  user: {row['user']}\n  assistant: ", nl=False)
        elif event == "piece":
            click.echo(row["text"].replace("\n", "\n             "), nl=False)
            sys.stdout.flush()
        elif event == "verified":
            click.echo(f"\nhash chain {'intact' if row['hash_chain_ok'] else 'BROKEN: ' + str(row['problems'])}; "
                       f"audit it with `snapkv-sessions replay {row['session_id']}`")
        else:
            roles = ", ".join(f"{r} {v:.0%}" for r, v in row["kept_per_role"].items())
            click.echo(
                f"\n  context {row['context_tokens']} tok with the reply -> cache {row['cache_after']} per layer/head; "
                f"kept {roles}; "
                f"compression {row['compression_ms']:.1f} ms; drift {row['decision']}; "
                f"re-prefill {'yes' if row['reprefill'] else 'no'}; "
                f"expected {row['expected']!r}: {'found' if row['correct'] else 'NOT found'}"
            )


@main.group()
def bench() -> None:
    """Benchmarks that print figures (JSON and a table)."""


@bench.command("overhead")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--lengths", default="2048,4096,8192", show_default=True, help="Comma-separated context lengths.")
@click.option("--budget-ratio", default=0.1, show_default=True, help="Budget as a share of the context.")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--kernel", default=7, show_default=True, help="Pooling kernel.")
@click.option("--repeats", default=2, show_default=True, help="Repeats per length (median reported).")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_overhead(model, lengths, budget_ratio, window, kernel, repeats, as_json) -> None:
    """Compression time as a share of prefill time, per context length."""
    from .bench import overhead
    from .config import CompressionConfig

    quiet_loaders()
    try:
        sizes = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"--lengths={lengths!r}: give integers separated by commas") from None
    if not sizes or min(sizes) < window + 1:
        raise click.BadParameter(f"--lengths={lengths!r}: each length must exceed the window ({window})")
    cfg = CompressionConfig.make(budget_ratio=budget_ratio, window=window, kernel=kernel)
    result = overhead.run(model, sizes, cfg, repeats=repeats)
    click.echo(json.dumps(result, indent=2))
    if not as_json:
        click.echo(overhead.table(result), err=False)


@bench.command("speed")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, help="Comma-separated context lengths.")
@click.option("--budgets", default="0.05,0.1,0.2,0.5", show_default=True, help="Budget ratios (full is always run).")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--steps", default=32, show_default=True, help="Decode steps timed per budget.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG of TPOT and speedup vs the bound.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_speed(model, lengths, budgets, window, steps, plot_path, as_json) -> None:
    """Prefill, compression overhead, TTFT, TPOT p50/p95/p99 and KV bytes per length and budget."""
    need_matplotlib(plot_path)
    from .bench import speed

    quiet_loaders()
    result = speed.run(model, [int(x) for x in lengths.split(",")], [float(x) for x in budgets.split(",")],
                       window=window, steps=steps)
    click.echo(json.dumps(result, indent=2))
    if plot_path:
        speed.plot(result, plot_path)
    if not as_json:
        click.echo(speed.table(result))


@bench.command("tier")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--lengths", default="4096", show_default=True, help="Comma-separated context lengths.")
@click.option("--ratio", default=0.2, show_default=True, help="Budget ratio of the hot cache.")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--new-tokens", default=50, show_default=True, help="New tokens per turn.")
@click.option("--repeats", default=3, show_default=True, help="Turns timed per length.")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16"]), show_default=True)
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_tier(model, lengths, ratio, window, new_tokens, repeats, dtype, out, as_json) -> None:
    """A turn on the tiered memory against a re-prefill, side by side: time, kept set, hot and cold bytes."""
    from .bench import tier

    quiet_loaders()
    result = tier.run(model, [int(x) for x in lengths.split(",")], ratio, window, new_tokens, repeats, dtype)
    _emit(result, out, as_json, tier.table)


@bench.command("detector")
@click.option("--scenarios", default=40, show_default=True, help="Scenarios per kind and shape.")
@click.option("--threshold", default=None, type=float, help="Also score at this drift threshold.")
@click.option("--calibration", default=40, show_default=True, help="Held-out scenarios per cell for the threshold.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_detector(scenarios, threshold, calibration, out, as_json) -> None:
    """Drift detector precision and recall by shape (document as a message or pasted) and record kind."""
    from .bench import detector

    quiet_loaders()
    _emit(detector.run(scenarios, threshold, calibration), out, as_json, detector.table)


@bench.command("quality")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--items", "n_items", default=5, show_default=True,
              help="Scenarios (a lookup, a copy, a switch and the rule in 5 role splits each).")
@click.option("--ratio", default=0.7, show_default=True, help="Budget ratio for the compressed methods.")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap.")
@click.option("--records", default=20, show_default=True, help="Directory records per document.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG bar chart here.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_quality(model, n_items, ratio, window, max_new_tokens, records, plot_path, out, as_json) -> None:
    """Accuracy per task and role split: full cache, session, StreamingLLM, SnapKV without pins or recovery."""
    need_matplotlib(plot_path)
    from .bench import quality

    quiet_loaders()
    log = (lambda *_: None) if as_json else (lambda msg: click.echo(msg, err=True))
    result = quality.run_quality(quality.load_runner(model), n_items, ratio, window, max_new_tokens, records, log=log)
    result["model"] = model
    if plot_path:
        quality.quality_plot(result, plot_path)
    _emit(result, out, as_json, quality.quality_table)


@bench.command("knee")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--items", "n_items", default=20, show_default=True, help="Items per task and length.")
@click.option("--budgets", default="0.05,0.1,0.2,0.3,0.5,0.7,0.9", show_default=True, help="Budget ratios.")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap.")
@click.option("--lengths", default="1024,2048,4096,8192", show_default=True, help="Target prompt lengths (tokens).")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16"]), show_default=True,
              help="bfloat16 prefills about 1.6x faster on AMX CPUs; tests keep float32.")
@click.option("--plot", "plot_path", default=None, help="Write the B*-vs-length PNG here.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_knee(model, n_items, budgets, window, max_new_tokens, lengths, dtype, plot_path, out, as_json) -> None:
    """B*(length): the smallest budget within 2 points of the full cache, per task and selection, with intervals."""
    need_matplotlib(plot_path)
    from .bench import knee, quality

    quiet_loaders()
    log = (lambda *_: None) if as_json else (lambda msg: click.echo(msg, err=True))
    result = knee.run(quality.load_runner(model, dtype), [int(x) for x in lengths.split(",")], n_items,
                      [float(b) for b in budgets.split(",")], window, max_new_tokens, log=log)
    result["model"], result["dtype"] = model, dtype
    if plot_path:
        knee.plot(result, plot_path)
    _emit(result, out, as_json, knee.table)


def _emit(result: dict, out: str | None, as_json: bool, table, bulky: str = "rows") -> None:
    """Write the whole JSON to ``out``; print it whole (``--json``) or without its bulky per-item part, plus a table."""
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as fh:
            fh.write(text)
    click.echo(text if as_json else json.dumps({k: v for k, v in result.items() if k != bulky}, indent=2))
    if not as_json:
        click.echo(table(result))


@bench.command("shift")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--sessions", "n_sessions", default=6, show_default=True, help="Scripted sessions (10 turns each).")
@click.option("--ratios", default="0.1,0.2,0.3,0.5", show_default=True, help="Budget ratios for the single-turn search.")
@click.option("--ratio", default=None, type=float, help="Skip the search and use this budget ratio.")
@click.option("--threshold", default=None, type=float, help="Drift threshold for (c); default: calibrated.")
@click.option("--calibration", default=40, show_default=True, help="Held-out scenarios for the threshold.")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap per turn.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_shift(model, n_sessions, ratios, ratio, threshold, calibration, window, max_new_tokens, out,
                as_json) -> None:
    """Accuracy under task shifts: full cache, SnapKV, SnapKV + drift re-prefill, re-prefill every turn."""
    from .bench import shift

    quiet_loaders()
    sizes = [float(x) for x in ratios.split(",") if x.strip()]
    log = (lambda *_: None) if as_json else (lambda msg: click.echo(msg, err=True))
    result = shift.run(model, n_sessions, sizes, window, max_new_tokens, ratio=ratio, threshold=threshold,
                       calibration=calibration, log=log)
    _emit(result, out, as_json, shift.table, bulky="turns")


@bench.command("forks")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--requests", default=20, show_default=True, help="Identical requests sent at once.")
@click.option("--batch", default=8, show_default=True, help="The servers' decode slots.")
@click.option("--document-tokens", default=1024, show_default=True, help="The conversation's document, in tokens.")
@click.option("--boundaries", type=click.Choice(["off", "on", "both"]), default="both", show_default=True,
              help="Servers with kept turn boundaries (the default), without (serve --no-fork-boundaries), or both.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_forks(model, requests, batch, document_tokens, boundaries, out, as_json) -> None:
    """The same conversation sent N times at once: forks from the kept boundary against forks that re-prefill."""
    from .bench import forks

    modes = {"off": (False,), "on": (True,), "both": (False, True)}[boundaries]
    log = (lambda *_: None) if as_json else (lambda msg: click.echo(msg, err=True))
    _emit(forks.run(model, requests, batch, document_tokens, modes, log=log), out, as_json, forks.table)


@bench.command("serve")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--clients", default="1,2,4,8", show_default=True, help="Concurrent clients, one level per value.")
@click.option("--turns", default=3, show_default=True, help="Turns per client (each a streamed request).")
@click.option("--max-tokens", default=32, show_default=True, help="Reply cap per turn.")
@click.option("--batch", "batches", default="0,8", show_default=True,
              help="Servers to compare, one per value: decode slots (0: one turn at a time).")
@click.option("--budget", default=512, show_default=True, help="KV budget of the sessions (without --policy).")
@click.option("--packed-weights", type=click.Choice(["off", "on", "both"]), default="off", show_default=True,
              help="Servers with packed linear weights (serve --packed-weights), without, or both side by side.")
@click.option("--document-tokens", default=0, show_default=True,
              help="Each client's first message starts with a document of about this many tokens.")
@click.option("--max-queue", default=16, show_default=True, help="The server's queue length.")
@click.option("--policy", default=None, help="Policy for the server's sessions (name or YAML path).")
@click.option("--base-url", default=None, help="A running server (default: start one on a free loopback port).")
@click.option("--api-key", default=None, help="Bearer key for a running server.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_serve(model, clients, turns, max_tokens, batches, budget, packed_weights, document_tokens, max_queue, policy,
                base_url, api_key, out, as_json) -> None:
    """N concurrent multi-turn clients against the server, batched and not: tokens/s (and the ratio), TTFT and
    TPOT p50/p95, 429s, errors."""
    from .bench import serve as serve_bench

    log = (lambda *_: None) if as_json else (lambda msg: click.echo(msg, err=True))
    spec = serve_bench.ServeBench(model, _int_list("clients", clients), turns, max_tokens,
                                  tuple(_int_list("batch", batches)), max_queue, policy, budget,
                                  {"off": (False,), "on": (True,), "both": (False, True)}[packed_weights],
                                  max(0, document_tokens))
    result = serve_bench.run(spec, base_url, api_key, log=log)
    _emit(result, out, as_json, serve_bench.table, bulky="turns")


@bench.command("ray")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--db", required=True, help="The store both servers share (PostgreSQL URL).")
@click.option("--replicas", default=1, show_default=True, help="Engine replicas of the Ray application.")
@click.option("--clients", default="4", show_default=True, help="Concurrent clients, one level per value.")
@click.option("--turns", default=3, show_default=True, help="Turns per client (each a streamed request).")
@click.option("--max-tokens", default=32, show_default=True, help="Reply cap per turn.")
@click.option("--batch", default=8, show_default=True, help="Decode slots of every server.")
@click.option("--budget", default=512, show_default=True, help="KV budget of the sessions (without --policy).")
@click.option("--policy", default=None, help="Policy for the servers' sessions (name or YAML path).")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_ray(model, db, replicas, clients, turns, max_tokens, batch, budget, policy, out, as_json) -> None:
    """The Ray Serve application against the single-process server (the routing overhead), and the rebuild time of
    a session from the store against its live prefill time."""
    from .bench import ray as ray_bench
    from .bench.serve import ServeBench

    log = (lambda *_: None) if as_json else (lambda msg: click.echo(msg, err=True))
    spec = ServeBench(model, _int_list("clients", clients), turns, max_tokens, (batch,), 16, policy, budget)
    result = ray_bench.run(spec, db, replicas, log=log)
    _emit(result, out, as_json, ray_bench.table, bulky="none")


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text[:80]!r}: give integers separated by commas", param_hint=f"--{name}") from None
    if not values or any(v < 0 for v in values):
        raise click.BadParameter(f"{text[:80]!r}: give non-negative integers", param_hint=f"--{name}")
    return values


@main.group()
def sessions() -> None:
    """Inspect stored sessions (no model, no torch)."""


def _store(db: str | None):
    """The store of a read-only command: a given path or URL must already hold a database."""
    from .store import SessionStore

    return SessionStore(db, must_exist=db is not None)


def _jsonable(obj):
    import datetime

    if isinstance(obj, Mapping):  # plain dicts and the store's records
        return {k: _jsonable(v) for k, v in obj.items() if not isinstance(v, (bytes, bytearray))}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, datetime.datetime):
        return obj.isoformat()
    return obj


@sessions.command("list")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def sessions_list(db, as_json) -> None:
    """List sessions: id, model, policy, turns, messages."""
    rows = [{k: r[k] for k in ("id", "created_at", "model_id", "title", "turns_done", "messages")}
            for r in _store(db).list_sessions()]
    if as_json:
        click.echo(json.dumps(_jsonable(rows), indent=2))
        return
    for r in rows:
        click.echo(f"{r['id']}  {r['created_at']:%Y-%m-%d %H:%M}  turns {r['turns_done']:>3}  "
                   f"messages {r['messages']:>3}  {r['model_id']}  {r['title'] or ''}")


@sessions.command("show")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def sessions_show(session_id, db, as_json) -> None:
    """Show a session's messages with their token spans, and check its hash chain."""
    store = _store(db)
    session_id = store.resolve_id(session_id)
    data = store.export(session_id)
    data["hash_chain_problems"] = store.verify(session_id)
    if as_json:
        click.echo(json.dumps(_jsonable(data), indent=2))
        if data["hash_chain_problems"]:
            sys.exit(1)
        return
    sess = data["session"]
    click.echo(f"session {sess['id']}  model {sess['model_id']}  turns {sess['turns_done']}  "
               f"policy {sess['policy_sha256'][:12]}")
    for m in data["messages"]:
        span = f"[{m['token_start']}, {m['token_end']})" if m["token_start"] is not None else "[not fed]"
        flag = " (abandoned)" if m["status"] != "active" else ""
        text = m["content"].replace("\n", " ")
        click.echo(f"{m['seq']:>4} {m['role']:<11} {span:<14} {text[:80]}{flag}")
    problems = data["hash_chain_problems"]
    click.echo("hash chain intact" if not problems else "hash chain BROKEN: " + "; ".join(problems))
    if problems:
        sys.exit(1)


@sessions.command("delete")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def sessions_delete(session_id, db, as_json) -> None:
    """Delete a session and everything recorded for it."""
    store = _store(db)
    session_id = store.resolve_id(session_id)
    store.delete_session(session_id)
    click.echo(json.dumps({"deleted": session_id}) if as_json else f"deleted {session_id}")


@sessions.command("export")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--json", "as_json", is_flag=True, help="JSON (the only format; accepted for uniformity).")
@clean_errors
def sessions_export(session_id, db, as_json) -> None:
    """Export a session (messages, turns, events) as JSON."""
    store = _store(db)
    click.echo(json.dumps(_jsonable(store.export(store.resolve_id(session_id))), indent=2))


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _kv_cells(row: dict, kv: str, tiered: bool) -> list[str]:
    tier = row.get("tier")
    if not tiered:
        return [kv]
    if not tier:
        return [kv, "-", "-"]
    return [f"{tier['hot_bytes']:,}/{tier['cold_bytes']:,}", f"{tier['streamed_bytes']:,}", str(tier["recalled"])]


def _replay_table(rows: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=None, box=None, pad_edge=False)
    cols = ["turn", "context", "kept", "system", "developer", "tool_schema", "document", "user", "assistant",
            "layer min..max", "drift", "decision", "comp ms", "prefill ms", "decode ms", "KV bytes"]
    tiered = any(r.get("tier") for r in rows)
    if tiered:  # hot/cold bytes after the turn, cold bytes streamed, slots recalled from cold to hot
        cols = cols[:-1] + ["hot/cold KV", "streamed", "recalled"]
    for col in cols:
        table.add_column(col, justify="right" if col not in ("decision",) else "left")
    for r in rows:
        roles = r["kept_per_role"]
        kept = _fmt(r["kept_min"]) if r["kept_min"] == r["kept_max"] else f"{r['kept_min']}..{r['kept_max']}"
        ret = "-" if r["retention_min"] is None else f"{r['retention_min']:.0%}..{r['retention_max']:.0%}"
        kv = "-" if r["kv_bytes_after"] is None else f"{r['kv_bytes_before']:,}->{r['kv_bytes_after']:,}"
        decision = r["drift_decision"] if r["status"] == "done" else r["status"]
        table.add_row(str(r["turn"]), _fmt(r["context_tokens"]), kept,
                      *[("-" if k not in roles else f"{roles[k]:.0%}") for k in cols[3:9]], ret,
                      _fmt(r["drift_score"], ".3f"), decision or "-", _fmt(r["compression_ms"], ".1f"),
                      _fmt(r["prefill_ms"], ".0f"), _fmt(r["decode_ms"], ".0f"), *_kv_cells(r, kv, tiered))
    console = Console(width=200, record=True, color_system=None, highlight=False, soft_wrap=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get().rstrip()


def _find_text(found: dict) -> str:
    """Per occurrence and turn: pairs holding every token, and each evicted token's count and median margin."""
    import statistics

    lines = [f"{found['text']!r}: {len(found['occurrences'])} occurrence(s)"]
    for occ in found["occurrences"]:
        lines.append(f"  chars {occ['chars'][0]}..{occ['chars'][1]}, positions {occ['positions']}, "
                     f"tokens {occ['tokens']}")
        for t in occ["turns"]:
            lines.append(f"    turn {t['turn']}: {t['pairs_holding_all']}/{t['pairs']} layer/head pairs hold every token")
            lost: dict[int, list] = {}
            for lay in t["layers"]:
                for head in lay["heads"]:
                    for e in head["evicted"]:
                        lost.setdefault(e["position"], []).append(e["margin"])
            for pos, margins in sorted(lost.items()):
                known = [m for m in margins if m is not None]
                median = f", median margin {statistics.median(known):.3g}" if known else ""
                lines.append(f"      position {pos} ({occ['tokens'][occ['positions'].index(pos)]!r}): evicted in "
                             f"{len(margins)} pairs{median}")
    return "\n".join(lines)


def _detail_text(detail: dict) -> str:
    lines = [f"turn {detail['turn']} ({detail['status']}): drift {_fmt(detail['drift_score'], '.3f')}, "
             f"decision {detail['drift_decision']}"]
    for e in detail["events"]:
        if e["kind"] in ("drift", "reprefill", "error", "abandoned", "recovered"):
            lines.append(f"  event {e['kind']}: {json.dumps(e['payload'], sort_keys=True)}")
    if not detail["layers"]:
        lines.append("  no compression this turn (the cache fit its budget)")
        return "\n".join(lines)
    lines.append("  kept / context tokens per message, min..max over layers and KV heads:")
    for m in detail["messages"]:
        held = [h["per_message"][m["seq"]]["kept"] for layer in detail["layers"] for h in layer]
        size = m["end"] - m["start"]
        lines.append(f"    msg {m['seq']:>3} {m['role']:<11} positions [{m['start']}, {m['end']}): kept "
                     f"{min(held)}..{max(held)} of {size}")
    recalled = [len(h["recalled"]) for layer in detail["layers"] for h in layer if "recalled" in h]
    if recalled:
        lines.append(f"  recalled from the cold tier to hot: {min(recalled)}..{max(recalled)} positions per layer "
                     f"and KV head ({sum(recalled)} in all; --json lists them)")
    return "\n".join(lines)


@main.command("replay")
@click.argument("session_id")
@click.option("--db", default=None, help="SQLAlchemy URL of the store (default: embedded SQLite).")
@click.option("--turn", type=int, default=None, help="Detail one turn: kept positions mapped to messages.")
@click.option("--verify", "do_verify", is_flag=True, help="Check the hash chain, then re-execute and compare.")
@click.option("--against", type=click.Choice(["full"]), default=None, help="Fidelity audit against a full cache.")
@click.option("--plot", "plot_path", default=None, help="Write a retention heatmap + drift timeline PNG (matplotlib).")
@click.option("--find", "find_text", default=None,
              help="Where TEXT's tokens were held or evicted after each compression (with --turn: that turn's), "
                   "and the score margin each evicted token lost by.")
@click.option("--model", default=None, help="Model for --verify/--against/--find (default: the session's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def replay(session_id, db, turn, do_verify, against, plot_path, find_text, model, as_json) -> None:
    """Audit a session: per-turn retention, drift and timings; verify or compare re-executions."""
    from . import audit

    need_matplotlib(plot_path)
    store = _store(db)
    session_id = store.resolve_id(session_id)
    if find_text is not None:
        quiet_loaders()
        found = audit.find(store, session_id, find_text, turn, model)
        click.echo(json.dumps(found, indent=2) if as_json else _find_text(found))
        return
    if do_verify:
        quiet_loaders()
        shown = (lambda *_: None) if as_json else (
            lambda done, total: click.echo(f"re-executed turn {done} of {total}", err=True))
        result = audit.verify(store, session_id, model, progress=shown)
        payload = {"ok": result.ok, "turns_checked": result.turns_checked,
                   "mismatch": None if result.mismatch is None else {
                       "turn": result.mismatch.turn, "field": result.mismatch.field,
                       "recorded": result.mismatch.expected, "reexecuted": result.mismatch.got}}
        click.echo(json.dumps(payload, indent=2) if as_json else (
            f"verified: hash chain intact, {result.turns_checked} turns re-executed identically" if result.ok
            else f"MISMATCH {result.mismatch}"))
        if not result.ok:
            raise SystemExit(1)
        return
    if against == "full":
        quiet_loaders()
        rows = audit.against_full(store, session_id, model)
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            for r in rows:
                first = ("identical" if r["first_divergence"] is None
                         else f"first divergence at token {r['first_divergence']}")
                click.echo(f"turn {r['turn']}: {r['tokens']} tokens, match {r['match_rate']:.0%}, {first}"
                           f"{'' if r['compressed'] else ' (uncompressed turn)'}")
        return
    if plot_path:
        from .policy import Policy

        threshold = Policy.from_yaml(store.get_session(session_id)["policy_json"]).drift.threshold
        shown = audit.plot(store, session_id, plot_path, turn=turn, threshold=threshold)
        click.echo(json.dumps({"plot": plot_path, "turn": shown}) if as_json else f"wrote {plot_path} (turn {shown})")
        return
    if turn is not None:
        detail = audit.turn_detail(store, session_id, turn)
        click.echo(json.dumps(_jsonable(detail), indent=2) if as_json else _detail_text(detail))
        return
    rows = audit.turn_rows(store, session_id)
    click.echo(json.dumps(_jsonable(rows), indent=2) if as_json else _replay_table(rows))


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _api_keys(keys: tuple[str, ...], key_file: str | None) -> frozenset[str]:
    """Keys from ``--api-key`` and from a file (one per line; blank lines and ``#`` comments skipped)."""
    found = {k.strip() for k in keys if k.strip()}
    if key_file is not None:
        try:
            lines = open(key_file, encoding="utf-8").read().splitlines()
        except OSError as exc:
            raise click.ClickException(f"--api-key-file={key_file!r}: cannot read it ({exc.strerror})") from None
        found |= {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    short = [k for k in found if len(k) < 16]
    if short:
        raise click.ClickException(f"--api-key: keys must be at least 16 characters ({len(short)} shorter)")
    return frozenset(found)


@main.command("serve")
@click.option("--model", required=True, help="Model id, folder, GGUF or bundle (one model per process).")
@click.option("--policy", default="default", show_default=True, help="Policy name or YAML path for new sessions.")
@click.option("--db", default=None, help="SQLAlchemy URL or SQLite path of the store (default: embedded SQLite).")
@click.option("--redis", "redis_url", default=None, help="Redis URL for locks and hot state (several workers).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, help="Port to bind.")
@click.option("--api-key", "api_keys", multiple=True, help="A bearer key clients must send (repeatable).")
@click.option("--api-key-file", default=None, help="A file of bearer keys, one per line.")
@click.option("--max-queue", default=16, show_default=True, help="Requests that may wait; more get 429.")
@click.option("--request-timeout", default=600.0, show_default=True, help="Seconds a request may wait and run.")
@click.option("--max-tokens", default=256, show_default=True, help="Reply cap when a request gives none.")
@click.option("--max-live", default=16, show_default=True, help="Sessions kept in memory (others rebuilt from the store).")
@click.option("--max-body-mb", default=8.0, show_default=True, help="Largest request body accepted (413 past it).")
@click.option("--batch", default=8, show_default=True,
              help="Decode slots: turns decoded together in one forward per step (0: one turn at a time).")
@click.option("--packed-weights", is_flag=True,
              help="CPU, fp32: run linear layers on weights packed once (faster batched steps; equal to rounding).")
@click.option("--ray", "on_ray", is_flag=True,
              help="Run as a Ray Serve application on a local Ray started on 127.0.0.1 (docs/ray.md).")
@click.option("--replicas", default=2, show_default=True, help="With --ray: engine replicas.")
@click.option("--max-messages", default=1024, show_default=True, help="Messages one request may carry; more get 400.")
@click.option("--docs", is_flag=True, help="Serve /docs, /redoc and /openapi.json, behind the API key when keys are set.")
@click.option("--shutdown-grace", default=10.0, show_default=True,
              help="Seconds running turns may finish after SIGTERM; then they are stopped with 503.")
@click.option("--no-fork-boundaries", is_flag=True,
              help="Keep no turn boundaries: a conversation sent again at once forks by re-prefilling its history.")
@clean_errors
def serve(model, policy, db, redis_url, host, port, api_keys, api_key_file, max_queue, request_timeout, max_tokens,
          max_live, max_body_mb, batch, packed_weights, on_ray, replicas, max_messages, docs, shutdown_grace,
          no_fork_boundaries) -> None:
    """An OpenAI-compatible server (POST /v1/chat/completions) over sessions."""
    _check_serve_numbers(port=port, max_queue=max_queue, request_timeout=request_timeout, max_tokens=max_tokens,
                         max_live=max_live, max_body_mb=max_body_mb, batch=batch, replicas=replicas,
                         max_messages=max_messages, shutdown_grace=shutdown_grace)
    keys = _api_keys(api_keys, api_key_file)
    if not keys and host not in LOOPBACK:
        click.echo(f"warning: no --api-key, and --host {host} is not a loopback address: anyone who can reach it "
                   "can use and read every session", err=True)
    if on_ray:
        _serve_ray({"model": model, "db": db, "policy": policy, "redis_url": redis_url, "replicas": replicas,
                    "sessions_per_replica": max_live, "batch": batch, "max_tokens": max_tokens,
                    "api_keys": tuple(keys), "request_timeout_s": request_timeout,
                    "max_body_bytes": int(max_body_mb * (1 << 20)), "max_messages": max_messages}, host, port)
        return
    try:
        from .serve import Capacity, ServeOptions, Service, create_app
        from .serve.app import run_server
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    from .store import SessionStore

    quiet_loaders()
    capacity = Capacity(max_live=max_live, max_tokens=max_tokens, batch=batch, packed_weights=packed_weights,
                        keep_boundaries=not no_fork_boundaries)
    store = SessionStore(db, redis_url=redis_url, pool_size=capacity.store_connections)
    service = Service(model, policy, store, capacity)
    app = create_app(service, ServeOptions(api_keys=keys, max_queue=max_queue, request_timeout_s=request_timeout,
                                           max_body_bytes=int(max_body_mb * (1 << 20)), max_messages=max_messages,
                                           docs=docs, shutdown_grace_s=shutdown_grace))
    click.echo(f"serving {service.model_id} on http://{host}:{port}/v1", err=True)
    run_server(app, host, port, shutdown_grace)


# serve's numeric options: the least value (int options), or (least, whether the least itself is allowed) for the
# float ones; --port also has a most. Checked before anything is imported or loaded, each refusal one line.
_SERVE_INTS = {"port": 0, "max_queue": 1, "max_tokens": 1, "max_live": 1, "batch": 0, "replicas": 1, "max_messages": 1}
_SERVE_FLOATS = {"request_timeout": (0.0, False), "max_body_mb": (0.0, False), "shutdown_grace": (0.0, True)}
MAX_PORT = 65535


def _check_serve_numbers(**values: float) -> None:
    """A bad numeric ``serve`` option is a one-line error naming it (exit 1), before the model is loaded: a
    request timeout of 0 would make every request a 504, a queue of 0 is unbounded, a port past 65535 never binds."""
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if name in _SERVE_INTS:
            least = _SERVE_INTS[name]
            most = MAX_PORT if name == "port" else None
            if value < least or (most is not None and value > most):
                bound = f"in {least}..{most}" if most is not None else f">= {least}"
                raise click.ClickException(f"{option}={value}: must be an integer {bound}")
            continue
        least, inclusive = _SERVE_FLOATS[name]
        if not math.isfinite(value) or value < least or (value == least and not inclusive):
            raise click.ClickException(f"{option}={value:g}: must be a finite number {'>=' if inclusive else '>'} "
                                       f"{least:g}")
    if int(values["max_body_mb"] * (1 << 20)) < 1:
        raise click.ClickException(f"--max-body-mb={values['max_body_mb']:g}: must allow at least one byte")


def _serve_ray(spec: dict, host: str, port: int) -> None:
    """The server as a Ray Serve application on a local Ray (127.0.0.1), until interrupted."""
    if host not in LOOPBACK:
        raise click.ClickException(f"--host {host}: with --ray the local cluster binds 127.0.0.1; for a cluster "
                                   "across machines deploy the Serve config file (docs/ray.md)")
    if not spec["db"] or not str(spec["db"]).startswith(("postgresql", "sqlite")):
        raise click.ClickException("--db: with --ray give the store's SQLAlchemy URL (PostgreSQL for several "
                                   "replicas on several machines)")
    try:
        from ray import serve as ray_serve

        from .serve.ray import build, start_local
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    start_local(port)
    ray_serve.run(build(spec), name="snapkv", route_prefix="/")
    replicas = spec["replicas"]
    click.echo(f"serving {spec['model']} on http://127.0.0.1:{port}/v1 ({replicas} replica{'s' * (replicas != 1)})",
               err=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        ray_serve.shutdown()


@main.command("resolve")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@clean_errors
def resolve(model: str, as_json: bool) -> None:
    """Resolve (and convert once) a model; print the folder it loads from."""
    from .models import resolve_model

    path = resolve_model(model)
    click.echo(json.dumps({"model": model, "path": path}) if as_json else path)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
