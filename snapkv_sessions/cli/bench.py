"""``snapkv-sessions bench``: benchmarks that print figures (JSON and a table)."""

from __future__ import annotations

import json
import os

import click

from .. import progress
from ..models import DTYPE_CHOICES
from . import clean_errors, main, need_matplotlib, quiet_loaders


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
    from ..bench import overhead
    from ..config import CompressionConfig

    quiet_loaders()
    try:
        sizes = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"--lengths={lengths!r}: give integers separated by commas") from None
    if not sizes or min(sizes) < window + 1:
        raise click.BadParameter(f"--lengths={lengths!r}: each length must exceed the window ({window})")
    cfg = CompressionConfig.make(budget_ratio=budget_ratio, window=window, kernel=kernel)
    with progress.task(f"bench overhead: {len(sizes)} length(s) x {repeats} repeat(s)"):
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
    from ..bench import speed

    quiet_loaders()
    with progress.task("bench speed"):
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
    from ..bench import tier

    quiet_loaders()
    with progress.task("bench tier: tiered turns against re-prefills"):
        result = tier.run(model, [int(x) for x in lengths.split(",")], ratio, window, new_tokens, repeats, dtype)
    _emit(result, out, as_json, tier.table)


@bench.command("detector")
@click.option("--scenarios", default=40, show_default=True, help="Scenarios per kind and shape.")
@click.option("--threshold", default=None, type=float, help="Also score at this drift threshold.")
@click.option("--calibration", default=40, show_default=True, help="Held-out scenarios per cell for the threshold.")
@click.option("--tier", "model", default=None,
              help="With the tier: run tiered sessions of this model and score the attention signal beside the text "
                   "detector (without it: the text detector alone, model-free).")
@click.option("--budget-ratio", default=0.3, show_default=True, type=click.FloatRange(0.01, 1.0))
@click.option("--max-new-tokens", default=12, show_default=True, type=click.IntRange(1, 512))
@click.option("--results", default=None, help="With --tier: JSONL file, one line per scenario, appended; a rerun "
                                              "resumes.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_detector(scenarios, threshold, calibration, model, budget_ratio, max_new_tokens, results, out,
                   as_json) -> None:
    """Drift detector precision and recall by shape (document as a message or pasted) and record kind."""
    from ..bench import detector

    quiet_loaders()
    if model is None:
        with progress.task("bench detector"):
            result = detector.run(scenarios, threshold, calibration)
        _emit(result, out, as_json, detector.table)
        return
    with progress.task("bench detector --tier") as shown:
        result = detector.run_tiered(model, scenarios, calibration, budget_ratio, max_new_tokens, results,
                                     log=shown.log)
    _emit(result, out, as_json, detector.table_tiered)


@bench.command("pointing")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True)
@click.option("--kinds", default="people,items,codes", show_default=True, help="bench detector's kinds of record.")
@click.option("--shapes", default="message", show_default=True, help="message, pasted, or both.")
@click.option("--seeds", default="0,1,2", show_default=True, help="Scenario seeds (at least 2: leave one out).")
@click.option("--heads", default="1,4,8", show_default=True, help="How many heads the pointed line sums, per level.")
@click.option("--floor", default=0.2, show_default=True, type=float,
              help="The lifted value a pointed line must exceed to count.")
@click.option("--budget-ratio", default=0.3, show_default=True, type=click.FloatRange(0.01, 1.0))
@click.option("--max-new-tokens", default=12, show_default=True, type=click.IntRange(1, 512))
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_pointing(model, kinds, shapes, seeds, heads, floor, budget_ratio, max_new_tokens, out, as_json) -> None:
    """Where single window rows point (as lift over the session's earlier turns), read as a task-shift signal on
    tiered sessions of bench detector's scenarios: AUC and precision/recall, heads chosen leaving one seed out."""
    from ..bench import detector, pointing
    from ..errors import bounded_repr

    kind_list, shape_list = _split((kinds,)), _split((shapes,))
    for name, values, allowed in (("--kinds", kind_list, detector.KINDS), ("--shapes", shape_list, detector.SHAPES)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise click.BadParameter(f"{bounded_repr(bad)}: choose from {', '.join(allowed)}", param_hint=name)
    seed_list = _int_list("seeds", seeds)
    if len(set(seed_list)) < 2:
        raise click.BadParameter("give at least two seeds (heads are chosen on the others)", param_hint="--seeds")
    quiet_loaders()
    with progress.task("bench pointing") as shown:
        result = pointing.run(model, kind_list, shape_list, seed_list, _int_list("heads", heads), floor,
                              budget_ratio, max_new_tokens, log=shown.log)
    _emit(result, out, as_json, pointing.table)


@bench.command("quality")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--items", "n_items", default=5, show_default=True,
              help="Scenarios (a lookup, a copy, a switch and the rule in 5 role splits each).")
@click.option("--ratio", default=0.7, show_default=True, help="Budget ratio for the compressed methods.")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap.")
@click.option("--records", default=20, show_default=True, help="Directory records per document.")
@click.option("--methods", default=None, help="Comma-separated subset of the methods (the full cache always runs).")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16"]), show_default=True)
@click.option("--plot", "plot_path", default=None, help="Write a PNG bar chart here.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_quality(model, n_items, ratio, window, max_new_tokens, records, methods, dtype, plot_path, out,
                  as_json) -> None:
    """Accuracy per task and role split: full cache, session, StreamingLLM, SnapKV without pins or recovery."""
    need_matplotlib(plot_path)
    from ..bench import quality

    quiet_loaders()
    chosen = quality.METHODS
    if methods is not None:
        chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
        if not chosen:
            raise click.BadParameter(f"{methods[:80]!r}: choose from {', '.join(quality.METHODS)}",
                                     param_hint="--methods")
        for method in chosen:
            try:
                quality.check_method(method)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--methods") from None
    runner = quality.load_runner(model, dtype)
    with progress.task(f"bench quality: {n_items} item(s)", total=n_items) as shown:  # it logs one line per item
        result = quality.run_quality(runner, n_items, ratio, window, max_new_tokens, records, log=shown.step,
                                     methods=chosen)
    result["model"], result["dtype"] = model, dtype
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
    from ..bench import knee, quality

    quiet_loaders()
    sizes = [int(x) for x in lengths.split(",")]
    runner = quality.load_runner(model, dtype)
    # knee.run logs one line per length and task
    with progress.task(f"bench knee: {len(sizes)} length(s) x {len(knee.TASKS)} tasks",
                       total=len(sizes) * len(knee.TASKS)) as shown:
        result = knee.run(runner, sizes, n_items, [float(b) for b in budgets.split(",")], window, max_new_tokens,
                          log=shown.step)
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
    from ..bench import shift

    quiet_loaders()
    sizes = [float(x) for x in ratios.split(",") if x.strip()]
    with progress.task(f"bench shift: {n_sessions} session(s)") as shown:
        result = shift.run(model, n_sessions, sizes, window, max_new_tokens, ratio=ratio, threshold=threshold,
                           calibration=calibration, log=shown.log)
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
    from ..bench import forks

    modes = {"off": (False,), "on": (True,), "both": (False, True)}[boundaries]
    with progress.task(f"bench forks: {requests} identical requests") as shown:
        result = forks.run(model, requests, batch, document_tokens, modes, log=shown.log)
    _emit(result, out, as_json, forks.table)


@bench.command("serve")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--clients", default="1,2,4,8", show_default=True, help="Concurrent clients, one level per value.")
@click.option("--turns", default=3, show_default=True, help="Turns per client (each a streamed request).")
@click.option("--max-tokens", default=32, show_default=True, help="Reply cap per turn.")
@click.option("--batch", "batches", default="0,8", show_default=True,
              help="Servers to compare, one per value: decode slots (0: one turn at a time).")
@click.option("--budget", default=512, show_default=True, help="KV budget of the sessions (without --policy).")
@click.option("--budgets", default=None,
              help="Our servers at several budgets side by side, e.g. full,0.5,0.2: 'full' (no compression) or "
                   "budget ratios in (0, 1] (compression.budget_ratio, replacing --budget or the policy's budget).")
@click.option("--packed-weights", type=click.Choice(["auto", "off", "on", "both"]), default="auto", show_default=True,
              help="Servers with packed linear weights (serve --packed-weights), without (--no-packed-weights), both "
                   "side by side, or serve's default (auto: packed for bf16 on a CPU with native bf16).")
@click.option("--metrics", "metrics", type=click.Choice(["on", "off", "both"]), default="on", show_default=True,
              help="Servers with GET /metrics (the default), without (serve --no-metrics), or both side by side: "
                   "the vs_no_metrics ratio is what the metrics cost.")
@click.option("--document-tokens", default=0, show_default=True,
              help="Each client's first message starts with a document of about this many tokens.")
@click.option("--max-queue", default=16, show_default=True, help="The server's queue length.")
@click.option("--policy", default=None, help="Policy for the server's sessions (name or YAML path).")
@click.option("--base-url", default=None, help="A running server (default: start one on a free loopback port).")
@click.option("--api-key", default=None, help="Bearer key for a running server.")
@click.option("--against", "against", multiple=True,
              help="Another OpenAI-compatible server's base URL (vLLM, SGLang, llama.cpp), e.g. "
                   "http://127.0.0.1:8001/v1: the same workload runs against it after ours (repeatable, or commas).")
@click.option("--against-model", "against_models", multiple=True,
              help="The model id each --against server expects, by position (default: its GET /v1/models' first).")
@click.option("--against-key", default=None, help="Bearer key for the --against servers.")
@click.option("--against-pid", "against_pids", multiple=True,
              help="The process id of each --against server, by position: its process tree's RSS is read.")
@click.option("--against-only", is_flag=True, help="Run only the --against servers, none of ours.")
@click.option("--allow-remote", is_flag=True, help="Allow an --against server that is not on 127.0.0.1, ::1 or localhost.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_serve(model, clients, turns, max_tokens, batches, budget, budgets, packed_weights, metrics, document_tokens,
                max_queue, policy, base_url, api_key, against, against_models, against_key, against_pids, against_only,
                allow_remote, out, as_json) -> None:
    """N concurrent multi-turn clients against the server, batched and not, at several budgets, and against other
    OpenAI-compatible servers: tokens/s (and the ratios), TTFT first and later turns, TPOT p50/p95, RSS, errors."""
    from ..bench import serve as serve_bench
    from ..errors import ConfigError, bounded_repr

    urls = _split(against)
    if against_only and not urls:
        raise click.BadParameter("give at least one --against server", param_hint="--against-only")
    if budgets is not None and base_url:
        raise click.BadParameter(f"{budgets[:80]!r}: a running server's budget is its own; leave out --base-url",
                                 param_hint="--budgets")
    try:
        pids = [int(p) for p in _split(against_pids)]
    except ValueError:
        raise click.BadParameter(f"{bounded_repr(against_pids)}: give process ids", param_hint="--against-pid") from None
    spec = serve_bench.ServeBench(model, _int_list("clients", clients), turns=turns, max_tokens=max_tokens,
                                  batches=tuple(_int_list("batch", batches)), max_queue=max_queue, policy=policy,
                                  budget=budget,
                                  packed={"auto": (None,), "off": (False,), "on": (True,),
                                          "both": (False, True)}[packed_weights],
                                  metrics={"on": (True,), "off": (False,), "both": (False, True)}[metrics],
                                  document_tokens=max(0, document_tokens),
                                  budgets=_budget_list(budgets) if budgets is not None else (), ours=not against_only)
    if spec.budgets:
        for b in spec.budgets:  # a policy these budgets cannot make is refused before any server starts
            spec.sessions_policy(b)
    try:
        spec.against = serve_bench.against_targets(urls, _split(against_models), pids, against_key, allow_remote)
    except ConfigError as exc:
        raise click.BadParameter(f"{bounded_repr(exc.value)}: {exc.reason}", param_hint="--against") from None
    with progress.task("bench serve") as shown:
        result = serve_bench.run(spec, base_url, api_key, log=shown.log)
    _emit(result, out, as_json, serve_bench.table, bulky="turns")


def _split(values: tuple[str, ...]) -> list[str]:
    """A repeatable option's values, each of which may be a comma list, in order."""
    return [v.strip() for text in values for v in text.split(",") if v.strip()]


def _budget_list(text: str) -> tuple[float | str, ...]:
    out: list[float | str] = []
    for v in (x.strip() for x in text.split(",") if x.strip()):
        if v.lower() == "full":
            out.append("full")
            continue
        try:
            ratio = float(v)
        except ValueError:
            ratio = -1.0
        if not 0.0 < ratio <= 1.0:
            raise click.BadParameter(f"{v[:80]!r}: give 'full' or budget ratios in (0, 1]", param_hint="--budgets")
        out.append(ratio)
    if not out:
        raise click.BadParameter(f"{text[:80]!r}: give 'full' or budget ratios in (0, 1]", param_hint="--budgets")
    return tuple(out)


@bench.command("dashboard")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--clients", default="1,4", show_default=True, help="Concurrent sessions, one level after the other.")
@click.option("--turns", default=3, show_default=True, help="Turns per client.")
@click.option("--max-tokens", default=24, show_default=True, help="Reply cap per turn.")
@click.option("--document-tokens", default=600, show_default=True,
              help="Each client's first message starts with a document of about this many tokens.")
@click.option("--batch", default=4, show_default=True, help="The server's decode slots.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between two scrapes of /metrics.")
@click.option("--window", default=8, show_default=True, help="Scrapes a rate() spans ($__rate_interval).")
@click.option("--plot", default=None, help="Write the dashboard's picture here (PNG).")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_dashboard(model, clients, turns, max_tokens, document_tokens, batch, interval, window, plot, out,
                    as_json) -> None:
    """The Grafana dashboard's panels (deploy/grafana) evaluated over a live server's scrapes under a known
    workload, and drawn: per panel and query, the scrapes that gave it a value."""
    from ..bench import dashboard

    with progress.task("bench dashboard") as shown:
        result = dashboard.run(model, _int_list("clients", clients), turns, max_tokens, document_tokens, batch,
                               interval, window, plot, log=shown.log)
    _emit(result, out, as_json, dashboard.table, bulky="none")


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
    from ..bench import ray as ray_bench
    from ..bench.serve import ServeBench

    spec = ServeBench(model, _int_list("clients", clients), turns, max_tokens, (batch,), 16, policy, budget)
    with progress.task("bench ray") as shown:
        result = ray_bench.run(spec, db, replicas, log=shown.log)
    _emit(result, out, as_json, ray_bench.table, bulky="none")


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text[:80]!r}: give integers separated by commas", param_hint=f"--{name}") from None
    if not values or any(v < 0 for v in values):
        raise click.BadParameter(f"{text[:80]!r}: give non-negative integers", param_hint=f"--{name}")
    return values


def _float_list(name: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: give comma-separated numbers", param_hint=name) from None
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise click.BadParameter(f"{text!r}: every ratio must be in [0, 1]", param_hint=name)
    return values


@bench.command("recall")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--sessions", "n_sessions", default=2, show_default=True,
              help="Scripted bench shift sessions (10 turns each).")
@click.option("--first-seed", default=500, show_default=True,
              help="The first session's seed (sessions take consecutive seeds): later seeds are held out.")
@click.option("--hots", default="0.1,0.2", show_default=True, help="Hot budget ratios.")
@click.option("--recalls", default="0.05,0.1", show_default=True, help="Recall budgets, as shares of the context.")
@click.option("--selectors", default=None, show_default="every built-in one",
              help="Recall selectors, separated by commas; a selector may add '+mass' (rank slots by the group's "
                   "attention mass), '+layer' (share the budget over a layer's heads), '+tailN' (estimate the "
                   "rest from pages of N) and '+escM' (retake a step whose two best logits are within M with "
                   "the whole history): exact+mass+layer, lowrank+mass+tail32+esc1.")
@click.option("--max-new-tokens", default=40, show_default=True, help="Reply length cap per turn.")
@click.option("--results", default=None,
              help="JSONL file: one line per session and condition, appended; a rerun resumes.")
@click.option("--cost-lengths", default="4096,8192", show_default=True,
              help="Lengths for the TPOT comparison ('' skips it).")
@click.option("--steps", default=32, show_default=True, help="Decode steps timed per condition.")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1, 20),
              help="Rounds of the cost cells, every condition once a round in a turning order; TPOT is the median.")
@click.option("--selection", is_flag=True,
              help="Also: the share of each step's cold attention each selector's choice holds, against the "
                   "exact top-k and the best pages (the largest hot and recall budgets, the same sessions).")
@click.option("--page", "pages", default="8,16", show_default=True,
              help="With --selection: page sizes of the pages selector.")
@click.option("--misses", default=None,
              help="Conditions (as the results file names them, e.g. hot0.2+lowrank0.1+mass) whose first reply that "
                   "parts from the full cache's is read: the full cache's logit margin at the first differing token "
                   "(needs --results with the grid's rows and the grid's --max-new-tokens).")
@click.option("--dtype", default="bfloat16", type=click.Choice(["float32", "bfloat16"]), show_default=True)
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_recall(model, n_sessions, first_seed, hots, recalls, selectors, max_new_tokens, results, cost_lengths, steps,
                 rounds, selection, pages, misses, dtype, out, as_json) -> None:
    """Decode-time recall from the tier: replies equal to the full cache's, turn by turn, and TPOT side by side."""
    from ..bench import quality, recall
    from ..config import RecallConfig
    from ..errors import ConfigError
    from ..recall import SELECTORS

    chosen = recall.SELECTORS if selectors is None else tuple(s.strip() for s in selectors.split(",") if s.strip())
    for spec in chosen:  # each checked as the policy would, before any model loads
        try:
            RecallConfig.make(ratio=0.1, **recall.recall_spec(spec))
        except (ValueError, ConfigError) as exc:
            raise click.BadParameter(f"{spec!r}: {exc} (registered selectors: {sorted(SELECTORS)})",
                                     param_hint="--selectors") from None
    quiet_loaders()
    hot_list, recall_list = _float_list("--hots", hots), _float_list("--recalls", recalls)
    page_sizes = _int_list("page", pages)  # checked before the grid runs, not after
    lengths = _int_list("cost-lengths", cost_lengths) if cost_lengths.strip() else []
    runner = quality.load_runner(model, dtype)
    with progress.task(f"bench recall: {n_sessions} session(s)") as shown:
        seeds = list(range(first_seed, first_seed + n_sessions))
        summary = recall.run_quality(runner, seeds, hot_list, recall_list,
                                     max_new_tokens, results, selectors=chosen, log=shown.log) if n_sessions else {}
        cost = recall.run_cost(runner, lengths, max(hot_list), max(recall_list), steps, log=shown.log,
                               selectors=chosen, rounds=rounds) if lengths else {}
        result = {"benchmark": "recall", "model": model, "dtype": dtype, "summary": summary, "cost": cost}
        if misses:
            if not results:
                raise click.BadParameter("give --results: the rows whose misses are read", param_hint="--misses")
            result["misses"] = recall.run_misses(runner, results, [m.strip() for m in misses.split(",") if m.strip()],
                                                 max_new_tokens, log=shown.log)
        if selection:
            ratio = max(recall_list)
            specs = {}
            for name in (c for c in chosen if "+" not in c):  # the selectors' own ranking (mass needs a whole step)
                for size in page_sizes if name == "pages" else [None]:
                    extra = {} if size is None else {"page": size}
                    specs[f"{name}{'' if size is None else size}"] = RecallConfig.make(ratio=ratio, selector=name,
                                                                                      **extra)
            result["selection"] = recall.run_selection(runner, seeds or [first_seed],
                                                       max(hot_list), ratio, max_new_tokens, specs, log=shown.log)

    def table(res: dict) -> str:
        return "\n\n".join(t for t in (recall.quality_table(res["summary"]) if res["summary"] else "",
                                       recall.cost_table(res["cost"]) if res["cost"] else "",
                                       recall.selection_table(res["selection"]) if res.get("selection") else "")
                           if t)

    _emit(result, out, as_json, table)


@bench.command("ruler")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--tasks", default=",".join(("niah_single_2", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt",
                                           "qa_1")), show_default=True, help="RULER tasks (any of the 13).")
@click.option("--lengths", default="4096,8192", show_default=True,
              help="Lengths in tokens (prompt + tokens to generate, RULER's definition).")
@click.option("--items", "n_items", default=20, show_default=True, help="Items per task and length.")
@click.option("--budgets", default="0.05,0.1,0.2,0.3,0.5,0.75", show_default=True, help="Budget ratios.")
@click.option("--settings", default="query-aware,query-agnostic,multi-turn", show_default=True,
              help="query-aware, query-agnostic, multi-turn (tiered and untiered sessions).")
@click.option("--methods", default="full,snapkv,lines,sentences,pyramid,adakv,streaming", show_default=True,
              help="Methods (full is always run).")
@click.option("--window", default=32, show_default=True, help="Observation window.")
@click.option("--max-new-tokens", default=None, type=int, help="Reply cap (default: RULER's per task).")
@click.option("--dtype", default="bfloat16", type=click.Choice(["float32", "bfloat16"]), show_default=True)
@click.option("--results", default=None, help="JSONL file: one line per finished row; what it holds is skipped.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue the results file (--no-resume: start it again).")
@click.option("--plot", "plot_path", default=None, help="Write the B*-vs-length PNG here.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_ruler(model, tasks, lengths, n_items, budgets, settings, methods, window, max_new_tokens, dtype, results,
                resume, plot_path, out, as_json) -> None:
    """RULER (offline) under compression: RULER's score per task, length, setting, method and budget; B* with
    90% intervals and the agreement with the full cache."""
    need_matplotlib(plot_path)
    from ..bench import quality, ruler

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    chosen = {"settings": [s.strip() for s in settings.split(",") if s.strip()],
              "methods": [m.strip() for m in methods.split(",") if m.strip()]}
    bad = [x for x in chosen["settings"] if x not in ruler.SETTINGS]
    if bad or not chosen["settings"]:
        raise click.BadParameter(f"{bad[0] if bad else ''!r}: one of {list(ruler.SETTINGS)}", param_hint="--settings")
    if not chosen["methods"]:
        raise click.BadParameter(f"'': one of {list(ruler.METHODS)}", param_hint="--methods")
    for method in chosen["methods"]:
        try:
            ruler.check_method(method)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--methods") from None
    try:
        ratios = [float(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        raise click.BadParameter(f"{budgets[:80]!r}: give numbers separated by commas", param_hint="--budgets") from None
    if results and not resume and os.path.exists(results):
        os.remove(results)
    quiet_loaders()
    runner = quality.load_runner(model, dtype)
    with progress.task("bench ruler") as shown:
        result = ruler.run(runner, model, names, _int_list("lengths", lengths), n_items, ratios, chosen["settings"],
                           chosen["methods"], window, max_new_tokens, results, dtype, log=shown.log)
    if plot_path:
        ruler.plot(result, plot_path)
    _emit(result, out, as_json, ruler.table, bulky="none")


@bench.command("dtype")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True,
              help="Model id, folder, GGUF or bundle.")
@click.option("--prompts", "n_prompts", default=8, show_default=True, help="Prompts (of the built-in set).")
@click.option("--max-new-tokens", default=24, show_default=True, help="Greedy tokens per reply.")
@click.option("--against", default="bfloat16", show_default=True,
              type=click.Choice([d for d in DTYPE_CHOICES if d not in ("auto", "float32")]),
              help="The dtype compared with float32 (fp16-weights, bf16-weights: 16-bit stored weights, fp32 math).")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_dtype(model, n_prompts, max_new_tokens, against, out, as_json) -> None:
    """A dtype against fp32 weights, side by side: identical greedy replies, first divergence, prefill and decode
    time."""
    from ..bench import dtype

    if not 1 <= n_prompts <= len(dtype.PROMPTS):
        raise click.ClickException(f"--prompts={n_prompts}: must be 1 to {len(dtype.PROMPTS)}")
    quiet_loaders()
    with progress.task(f"bench dtype: {against} against fp32 on {n_prompts} prompt(s)"):
        result = dtype.agreement(model, dtype.PROMPTS[:n_prompts], max_new_tokens, against)
    _emit(result.to_json(), out, as_json, lambda _: dtype.table(result))


@bench.command("compile")
@click.option("--model", default="smollm2-135m-instruct", show_default=True, help="Model id, folder, GGUF or bundle.")
@click.option("--rows", default="1,8", show_default=True, help="Comma-separated sessions per step.")
@click.option("--context", default=1024, show_default=True, help="Tokens in the cache before the steps.")
@click.option("--steps", default=16, show_default=True, help="Greedy steps timed per round (two rounds each).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Weights' dtype (auto: bf16 where the CPU runs it natively).")
@click.option("--backend", default="inductor", show_default=True, help="torch.compile backend.")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_compile(model, rows, context, steps, dtype, backend, out, as_json) -> None:
    """A decode step eager against torch.compile (static cache), side by side: time per step and equal tokens."""
    from ..bench import compile as compiled

    quiet_loaders()
    counts = _int_list("rows", rows)
    with progress.task(f"bench compile: {len(counts)} row count(s), eager and {backend}"):
        result = compiled.run(model, counts, context, steps, dtype, backend)
    _emit(result.to_json(), out, as_json, lambda _: compiled.table(result), bulky="none")


@bench.command("ruler-client")
@click.option("--url", required=True, help="The server's base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--model", default=None, help="The model id sent in requests (default: the server's GET /models).")
@click.option("--tokenizer", default=None,
              help="Model id, folder, GGUF or bundle whose tokenizer sizes the tasks (default: --model).")
@click.option("--tasks", default="niah_single_2", show_default=True, help="RULER tasks (any of the 13).")
@click.option("--lengths", default="4096", show_default=True,
              help="Lengths in tokens (prompt + tokens to generate, RULER's definition).")
@click.option("--items", "n_items", default=2, show_default=True, help="Items per task and length.")
@click.option("--max-new-tokens", default=None, type=int, help="Reply cap (default: RULER's per task).")
@click.option("--answer-prefix/--no-answer-prefix", default=True, show_default=True,
              help="End the user message with RULER's answer prefix (its base template), or leave it out.")
@click.option("--threads", default=1, show_default=True, help="call_api.py's concurrent requests.")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True, help="Seconds one request may take.")
@click.option("--api-key", default=None, help="Bearer key for the server.")
@click.option("--allow-remote", is_flag=True, help="Allow a server that is not on 127.0.0.1, ::1 or localhost.")
@click.option("--results", default=None, help="JSONL file: one line per finished item; what it holds is skipped.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue the results file (--no-resume: start it again).")
@click.option("--out", default=None, help="Also write the JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print only the JSON.")
@clean_errors
def bench_ruler_client(url, model, tokenizer, tasks, lengths, n_items, max_new_tokens, answer_prefix, threads,
                       timeout_s, api_key, allow_remote, results, resume, out, as_json) -> None:
    """RULER's own client (long_context_eval/pred/call_api.py) against an OpenAI-compatible server, on RULER tasks
    generated offline; RULER's score per task and length, and each request's wall time."""
    from ..bench import ruler_client
    from ..errors import ConfigError, bounded_repr

    try:
        ruler_client.check_url(url, allow_remote)
    except ConfigError as exc:
        raise click.BadParameter(f"{bounded_repr(url)}: {exc.reason}", param_hint="--url") from None
    if threads < 1 or n_items < 1:
        raise click.BadParameter(f"{min(threads, n_items)}: must be at least 1", param_hint="--threads/--items")
    if results and not resume and os.path.exists(results):
        os.remove(results)
    quiet_loaders()
    with progress.task("bench ruler-client") as shown:
        result = ruler_client.run(url, [t.strip() for t in tasks.split(",") if t.strip()],
                                  _int_list("lengths", lengths), n_items, tokenizer, model, results, max_new_tokens,
                                  answer_prefix, threads, timeout_s, api_key, allow_remote, log=shown.log)
    _emit(result, out, as_json, ruler_client.table, bulky="none")
