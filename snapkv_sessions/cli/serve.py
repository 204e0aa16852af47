"""``snapkv-sessions serve``: the OpenAI-compatible server, its option checks, API keys and the Ray variant."""

from __future__ import annotations

import json
import logging
import math
import time

import click

from .. import progress, stats
from ..models import DTYPE_CHOICES, ModelSpec
from . import clean_errors, main, quiet_loaders

LOOPBACK = ("127.0.0.1", "::1", "localhost")
log = logging.getLogger("snapkv_sessions.serve")  # the server's own logger (serve/app.py's request lines)


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
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(DTYPE_CHOICES),
              help="Weights' dtype; auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else fp16-weights "
                   "(fp32 arithmetic over fp16-stored linear weights) on AVX2 CPUs, else float32. "
                   "A session is bound to the dtype it ran in.")
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
@click.option("--packed-weights/--no-packed-weights", default=None,
              help="CPU: run linear layers on weights packed once (faster steps). Default: on for bf16 on a CPU with "
                   "native bf16 (the same bits), off for fp32 (equal to rounding, not bit for bit).")
@click.option("--ray", "on_ray", is_flag=True,
              help="Run as a Ray Serve application on a local Ray started on 127.0.0.1 (docs/ray.md).")
@click.option("--replicas", default=2, show_default=True, help="With --ray: engine replicas.")
@click.option("--max-messages", default=1024, show_default=True, help="Messages one request may carry; more get 400.")
@click.option("--docs", is_flag=True, help="Serve /docs, /redoc and /openapi.json, behind the API key when keys are set.")
@click.option("--shutdown-grace", default=10.0, show_default=True,
              help="Seconds running turns may finish after SIGTERM; then they are stopped with 503.")
@click.option("--warm-tokens", default=1024, show_default=True,
              help="Before taking requests, serve a throwaway session with a document of this many tokens so the "
                   "first request is as fast as the second (0: no warm start).")
@click.option("--metrics-need-key", is_flag=True,
              help="GET /metrics asks for the API key too (default: open, as vLLM's; /health and /ready always are).")
@click.option("--no-metrics", is_flag=True,
              help="No GET /metrics and no Prometheus sink (what bench serve --metrics both compares against).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="The server's log on stderr: one line per request, per turn, per fault, the drain and the stop; "
                   "json: one JSON object a line (docs/operations.md#logs).")
@click.option("--log-content", is_flag=True,
              help="A chat completion's request line carries its last user message, cut to 200 characters "
                   "(off by default: no message content in the logs).")
@click.option("--no-fork-boundaries", is_flag=True,
              help="Keep no turn boundaries: a conversation sent again at once forks by re-prefilling its history.")
@click.option("--trim-memory/--no-trim-memory", default=True, show_default=True,
              help="After every turn, give the memory its transient tensors freed back to the system (glibc's "
                   "malloc_trim; nothing elsewhere): RSS follows what the sessions hold, not the last peak.")
@clean_errors
def serve(model, policy, dtype, db, redis_url, host, port, api_keys, api_key_file, max_queue, request_timeout, max_tokens,
          max_live, max_body_mb, batch, packed_weights, on_ray, replicas, max_messages, docs, shutdown_grace,
          warm_tokens, no_fork_boundaries, trim_memory, metrics_need_key, no_metrics, log_format, log_content) -> None:
    """An OpenAI-compatible server (POST /v1/chat/completions) over sessions."""
    _check_serve_numbers(port=port, max_queue=max_queue, request_timeout=request_timeout, max_tokens=max_tokens,
                         max_live=max_live, max_body_mb=max_body_mb, batch=batch, replicas=replicas,
                         max_messages=max_messages, shutdown_grace=shutdown_grace, warm_tokens=warm_tokens)
    keys = _api_keys(api_keys, api_key_file)
    if on_ray and log_content:
        raise click.ClickException("--log-content is not offered with --ray (the Ray processes keep their own logs; "
                                   "docs/ray.md)")
    # JSON lines: every line of stderr is a record, so the start-up's progress is not shown, its lines are logged
    json_logs = log_format == "json"
    stats.configure_logging("INFO", log_format)
    model = ModelSpec.parse(model, dtype).model_id  # the id its sessions are stored under: name@dtype
    if packed_weights:
        from ..packed import DTYPES as PACKABLE

        if ModelSpec.parse(model).dtype not in PACKABLE:
            raise click.ClickException(f"--packed-weights packs {' or '.join(PACKABLE)} weights; this server runs "
                                       f"{model!r}")
    if not keys and host not in LOOPBACK:
        _say(f"warning: no --api-key, and --host {host} is not a loopback address: anyone who can reach it can use "
             "and read every session", json_logs, logging.WARNING)
    if on_ray:
        _serve_ray({"model": model, "db": db, "policy": policy, "redis_url": redis_url, "replicas": replicas,
                    "sessions_per_replica": max_live, "batch": batch, "max_tokens": max_tokens,
                    "api_keys": tuple(keys), "request_timeout_s": request_timeout,
                    "max_body_bytes": int(max_body_mb * (1 << 20)), "max_messages": max_messages,
                    "warm_tokens": warm_tokens, "log_format": log_format}, host, port)
        return
    try:
        from ..serve import Capacity, ServeOptions, Service, create_app
        from ..serve.app import run_server
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    from ..store import SessionStore

    quiet_loaders()
    capacity = Capacity(max_live=max_live, max_tokens=max_tokens, batch=batch, packed_weights=packed_weights,
                        keep_boundaries=not no_fork_boundaries, trim_memory=trim_memory)
    store = SessionStore(db, redis_url=redis_url, pool_size=capacity.store_connections)
    warmed = None
    with progress.quiet(json_logs), progress.task(f"starting the server on {model}") as shown:
        service = Service(model, policy, store, capacity)  # loads the model (its own line on a terminal)
        if warm_tokens:
            shown.update(f"warm start: a {warm_tokens}-token document and a follow-up")
            warmed = service.warm(warm_tokens).line()
            shown.log(warmed)  # stays above a live display; nothing under --log-format json (logged below)
    if warmed is not None and json_logs:
        log.info(warmed)
    app = create_app(service, ServeOptions(api_keys=keys, max_queue=max_queue, request_timeout_s=request_timeout,
                                           max_body_bytes=int(max_body_mb * (1 << 20)), max_messages=max_messages,
                                           docs=docs, shutdown_grace_s=shutdown_grace,
                                           metrics_need_key=metrics_need_key, metrics=not no_metrics,
                                           log_content=log_content))
    _say(f"serving {service.model_name} ({ModelSpec.parse(service.model_id).dtype}) on http://{host}:{port}/v1",
         json_logs)
    run_server(app, host, port, shutdown_grace)


def _say(line: str, json_logs: bool, level: int = logging.INFO) -> None:
    """A start-up line on stderr: plain as it always was, or a record of the server's logger under
    ``--log-format json`` (so that every line of stderr parses)."""
    if json_logs:
        log.log(level, line)
    else:
        click.echo(line, err=True)


# serve's numeric options: the least value (int options), or (least, whether the least itself is allowed) for the
# float ones; --port also has a most. Checked before anything is imported or loaded, each refusal one line.
_SERVE_INTS = {"port": 0, "max_queue": 1, "max_tokens": 1, "max_live": 1, "batch": 0, "replicas": 1, "max_messages": 1,
               "warm_tokens": 0}
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

        from ..serve.ray import build, start_local
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    with progress.task(f"starting Ray Serve: {spec['replicas']} replica(s) of {spec['model']}"):
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


@main.command("top")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The server's root (its GET /metrics is read), e.g. http://127.0.0.1:8000.")
@click.option("--api-key", default=None, help="Bearer key, for a server started with --metrics-need-key.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between two scrapes.")
@click.option("--window", default=15, show_default=True, help="Scrapes the rates and quantiles span.")
@click.option("--once", is_flag=True, help="Scrape twice, --interval apart, print the figures once and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per screen).")
@clean_errors
def top(url: str, api_key: str | None, interval: float, window: int, once: bool, as_json: bool) -> None:
    """A running server's live figures (requests, tokens/s, TTFT, TPOT, inter-token latency, re-prefills, pins, the
    cold-tier pool), read from its GET /metrics; Ctrl-C stops."""
    from urllib.parse import urlsplit

    from ..bench.dashboard import Scrape
    from ..serve.top import render, snapshot

    if interval <= 0 or window < 1:
        raise click.BadParameter(f"{interval!r}: give seconds > 0 and a window of at least 1", param_hint="--interval")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter(f"{url[:200]!r}: give the server's root, e.g. http://127.0.0.1:8000", param_hint="--url")
    metrics_url = url.strip().rstrip("/").removesuffix("/v1") + "/metrics"
    t0, scrapes = time.monotonic(), []
    try:
        while True:
            scrapes = [*scrapes[-window:], Scrape.fetch(metrics_url, api_key, t0)]
            if len(scrapes) >= 2:
                values = snapshot(scrapes, window)
                if as_json:
                    click.echo(json.dumps({"url": metrics_url, "t": round(scrapes[-1].t, 1), **values}))
                else:
                    if not once:
                        click.clear()
                    click.echo(f"{metrics_url}  (last {scrapes[-1].t - scrapes[0].t:.0f} s)\n{render(values)}")
                if once:
                    return
            time.sleep(interval)
    except KeyboardInterrupt:
        return
