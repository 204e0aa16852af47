"""The HTTP layer: FastAPI routes in OpenAI's shapes over :class:`~.service.Service`, SSE through sse-starlette.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, and the session endpoints ``GET /v1/sessions``,
``GET /v1/sessions/{id}``, ``POST /v1/sessions/{id}/verify``, ``POST /v1/sessions/{id}/fork``,
``DELETE /v1/sessions/{id}``; for operators ``GET /health`` (liveness), ``GET /ready`` (readiness) and
``GET /metrics`` (Prometheus, :mod:`.metrics`), outside ``/v1`` and without the API key (a probe sends none).
Every error is OpenAI's error body with the right status: 400 for a bad field
(named in ``param``), 401 without a valid key, 404 for a session the caller does not own, 409 when a named session
does not continue, 413 for a body past ``max_body_bytes``, 429 when the queue is full (with ``Retry-After``), 503
while shutting down, 504 past the deadline.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import stats
from ..errors import ConfigError, SnapKVError
from ..store import StoreError, StoreUnavailable
from ..threads import serial_kernels
from . import protocol
from .metrics import PrometheusSink
from .service import Conflict, NotFound, Service, TurnOutput, TurnRequest, at_least, owner_of
from .worker import Busy, DeadlineExceeded, Job, ShuttingDown, Worker

SESSION_HEADER = "X-Session-Id"
OPERATOR_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: every few seconds, not logged
CLIENT_LEFT = 499  # the status a request is counted with when its client left first (nginx's code)
log = logging.getLogger("snapkv_sessions.serve")


LOG_CONTENT_CHARS = 200  # characters of the last user message a request line carries with log_content
LOG_SCOPE = "snapkv.request_log"  # the ASGI scope key where RequestLog keeps what a route adds to its line


class RequestLog:
    """ASGI middleware: one record per HTTP request once its response has ended (a stream too) on the
    ``snapkv_sessions.serve`` logger: method, path, status, milliseconds and the session that served it, as the
    message and as the record's ``stat`` (``stat_type`` ``"http"``, so :class:`~snapkv_sessions.stats.JsonFormatter`
    writes the fields apart). Never a header: the API key travels in one. A route may add a field under the
    scope's :data:`LOG_SCOPE` (the chat route adds the bounded last user message when ``log_content`` is on)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPERATOR_PATHS:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        seen: dict = {"status": 500, "session": None}
        scope[LOG_SCOPE] = seen  # the routes see this scope dict itself (Starlette updates it, never copies it)

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == SESSION_HEADER.lower().encode():
                        seen["session"] = value.decode()[:64]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            fields = {"method": scope["method"], "path": scope["path"][:200], "status": seen["status"],
                      "ms": round(ms, 1), "session": seen["session"]}
            content = seen.get("content")
            if content is not None:
                fields["content"] = content
            log.info("%s %s %d %.0f ms session %s%s", fields["method"], fields["path"], fields["status"], ms,
                     fields["session"] or "-", "" if content is None else f" content {content!r}",
                     extra={"stat": fields, "stat_type": "http"})


def content_view(req: protocol.ChatCompletionRequest, limit: int = LOG_CONTENT_CHARS) -> str | None:
    """The request's last user message as a request line may carry it: its text parts, cut to ``limit``
    characters (an ellipsis marks a cut), so one line stays bounded whatever a client sends; None without one."""
    user = next((m for m in reversed(req.messages) if m.role == "user"), None)
    if user is None:
        return None
    if isinstance(user.content, str):
        text = user.content
    else:
        text = "".join(p.text or "" for p in user.content or [] if p.type == "text")
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


@dataclass
class ServeOptions:
    """How the server admits work: keys, queue length, per-request deadline, the size of one request, shutdown.

    max_messages: messages one request may carry (400 past it, before any is validated); docs: serve ``/docs``,
    ``/redoc`` and ``/openapi.json`` (behind the key when keys are set); shutdown_grace_s: after SIGTERM, how long
    running turns may finish before they are stopped (their clients get 503, their turns are abandoned);
    metrics_need_key: ``GET /metrics`` asks for the API key too (off by default, as vLLM's: a Prometheus scrape
    usually sends none, and the metrics carry no session id, key or content); metrics: ``GET /metrics`` and its
    sink (off: the route answers 404 and no Prometheus metric is kept; ``bench serve --metrics both`` measures
    what they cost); log_content: a chat completion's
    request line carries its last user message, cut to :data:`LOG_CONTENT_CHARS` (off by default: logs are often
    shipped and kept where conversations should not be).
    """

    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: no keys (local use)
    max_queue: int = 16
    request_timeout_s: float = 600.0
    max_body_bytes: int = 8 << 20  # a request body past this is refused (413) before it is parsed
    max_messages: int = 1024
    docs: bool = False
    shutdown_grace_s: float = 10.0
    metrics_need_key: bool = False
    metrics: bool = True
    log_content: bool = False

    def __post_init__(self) -> None:
        at_least(self, {"max_queue": 1, "max_body_bytes": 1, "max_messages": 1})
        for name, zero_ok in (("request_timeout_s", False), ("shutdown_grace_s", True)):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or value < 0 or (value == 0 and not zero_ok):
                raise ConfigError(name, value, f"must be a finite number of seconds {'>=' if zero_ok else '>'} 0")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error(str(self), self.kind, self.param, self.code), status_code=self.status,
                            headers=self.headers)


def as_api_error(exc: BaseException) -> ApiError:
    """Every failure as the error a client is shown: no traceback, a bounded message."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc)[:1000], "invalid_request_error", exc.param, "invalid_value")
    if isinstance(exc, NotFound):
        return ApiError(404, str(exc), "invalid_request_error", "session_id", "session_not_found")
    if isinstance(exc, Conflict):
        return ApiError(409, str(exc), "invalid_request_error", "messages", "history_mismatch")
    if isinstance(exc, Busy):
        return ApiError(429, str(exc), "rate_limit_error", None, "queue_full", {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), "server_error", None, "shutting_down", {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, StoreUnavailable):
        return ApiError(503, "the session store is not answering in time; nothing of this request was stored",
                        "server_error", None, "store_unavailable", {"Retry-After": str(exc.retry_after)})
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, str(exc), "timeout_error", None, "deadline_exceeded")
    if isinstance(exc, (StoreError, SnapKVError)):
        return ApiError(500, f"{type(exc).__name__}: {str(exc)[:500]}", "server_error")
    return ApiError(500, f"internal error ({type(exc).__name__})", "server_error")


def authorize(request: Request, api_keys: frozenset[str]) -> str | None:
    """The caller's owner digest from ``Authorization: Bearer <key>`` (401 without a valid key; None without keys)."""
    if not api_keys:
        return None
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in api_keys):
        raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                       "invalid_request_error", None, "invalid_api_key")
    return owner_of(key)


async def read_body(request: Request, max_bytes: int, required: bool = True) -> object:
    """The request's JSON body, read up to ``max_bytes`` (413 past it, 400 when it is not JSON)."""
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the body is larger than {max_bytes} bytes", "invalid_request_error", "body",
                         "body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
        if len(raw) > max_bytes:
            raise too_large
    if not raw.strip() and not required:
        return {}
    try:
        return protocol.loads(bytes(raw), "body")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body must be JSON", "invalid_request_error", "body", "invalid_json") from None


def completion_body(out: TurnOutput, model: str) -> dict:
    """A finished turn as OpenAI's chat completion object, with the session beside it."""
    use = protocol.usage(out.reply.prompt_tokens, out.reply.completion_tokens)
    return protocol.completion(protocol.completion_id(), model, out.content, out.calls, out.finish, use, _extra(out))


def stream_end(out: TurnOutput) -> dict:
    """What a streamed turn sends after its pieces, as plain data: the rest of the content (what was shown is a
    prefix of it), tool calls, the finish reason, the session fields and the usage."""
    calls = [{"index": i, **c} for i, c in enumerate(protocol.tool_calls(out.calls))] if out.calls else []
    return {"rest": out.content[len(out.shown):], "calls": calls, "finish": out.finish, "extra": _extra(out),
            "usage": protocol.usage(out.reply.prompt_tokens, out.reply.completion_tokens)}


def end_chunks(end: dict, req: protocol.ChatCompletionRequest, cid: str) -> list[str]:
    """The SSE data of a stream's end (:func:`stream_end`): the last delta with the finish reason, the usage when
    asked for, ``[DONE]``."""
    delta: dict = {"content": end["rest"]} if end["rest"] else {}
    if end["calls"]:
        delta["tool_calls"] = end["calls"]
    chunks = [json.dumps({**protocol.chunk(cid, req.model, delta, end["finish"]), **end["extra"]})]
    if req.stream_options is not None and req.stream_options.include_usage:
        chunks.append(json.dumps(protocol.chunk(cid, req.model, {}, use=end["usage"], choices=False)))
    return [*chunks, "[DONE]"]


class RequestTrack:
    """One chat completion request from its arrival to the end of its response, emitted once as a
    :class:`~snapkv_sessions.stats.RequestStat` (the serving figures of ``GET /metrics``).

    Its methods are called by the request path where each thing happens: :meth:`first_piece` when the turn's first
    piece is decoded (on the worker thread), :meth:`reply_done` when the reply is whole, :meth:`ok` or
    :meth:`failed` when the response has ended; only the first end counts."""

    def __init__(self) -> None:
        self.arrived = time.monotonic()
        self.stream = False
        self.job: Job | None = None
        self.first: float | None = None
        self.last: float | None = None
        self.done = False

    def first_piece(self, _session_id: str | None = None) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def reply_done(self) -> None:
        if self.last is None:
            self.last = time.monotonic()

    def ok(self, out: TurnOutput) -> None:
        self.answered(out.finish, out.reply.prompt_tokens, out.reply.completion_tokens)

    def answered(self, finish: str, prompt_tokens: int, completion_tokens: int) -> None:
        """The response ended with a reply (the Ray ingress reads these from the replica's answer)."""
        self._end(200, "ok", (finish, prompt_tokens, completion_tokens))

    def failed(self, exc: BaseException) -> None:
        """The response ended without a reply: ``exc`` as the client was told it (a CancelledError: it left)."""
        if isinstance(exc, asyncio.CancelledError):
            self._end(CLIENT_LEFT, "client_disconnected", None)
        else:
            err = as_api_error(exc)
            self._end(err.status, err.code or err.kind, None)

    def refused(self, status: int, code: str) -> None:
        """The response ended without a reply, with an error already made (a Ray replica's, as data)."""
        self._end(status, code, None)

    def _end(self, status: int, code: str, reply: tuple[str, int, int] | None) -> None:
        """``reply``: (finish reason, prompt tokens, completion tokens) when there is one."""
        if self.done:
            return
        self.done = True
        if not stats.active():
            return
        now, job = time.monotonic(), self.job
        started = job.started if job is not None else None
        # a request that failed after its job started had its turn stopped (abandoned): say why, when the job knows
        stopped = job.stop_cause() if job is not None and started is not None and reply is None else None
        first = self.first if reply is not None else None
        stats.emit(stats.RequestStat(
            status=status, code=code, stopped=stopped, stream=self.stream,
            finish_reason=reply[0] if reply is not None else None,
            queue_s=None if started is None else started - job.submitted,
            ttft_s=None if first is None else first - self.arrived,
            decode_s=None if first is None else (self.last or now) - first,
            e2e_s=now - self.arrived,
            prompt_tokens=reply[1] if reply is not None else 0,
            completion_tokens=reply[2] if reply is not None else 0))


def create_app(service: Service, options: ServeOptions | None = None) -> FastAPI:
    options = options or ServeOptions()
    worker: Worker | None = None
    # this app's metrics: fed by the stats stream while the app runs (process-wide: every session of the process)
    metrics = PrometheusSink(service.model_name, service.scheduler.pool.size if service.scheduler is not None else 0)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        nonlocal worker
        # the per-turn, fault and tier-loss records (stats.LogSink): written only where the package logger is
        # configured to show them (serve's --log-format), and dropped before they are built otherwise
        remove_sinks = [stats.add_sink(stats.LogSink()), *([stats.add_sink(metrics)] if options.metrics else [])]
        # with a scheduler the model runs on its thread alone; the workers' own tensor work stays serial
        # (snapkv_sessions.threads: a worker's OpenMP team slowed every decode step of the model's thread)
        worker = Worker(options.max_queue, threads=service.threads, serial_kernels=service.scheduler is not None)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close)  # the running turns finish; waiting ones are refused
            await asyncio.to_thread(service.close)
            for remove in remove_sinks:
                remove()
            log.info("stopped")

    # the schema pages are off unless asked for, and then behind the key like every route (see below)
    app = FastAPI(title="snapkv-sessions", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics
    app.add_middleware(RequestLog)

    def drain() -> None:
        """SIGTERM (:func:`run_server`): refuse new and waiting requests with 503, give the running turns
        ``shutdown_grace_s`` to finish, then stop them (503, or a stream's final error event)."""
        if worker is not None:
            log.info("SIGTERM: draining (%d running, %d waiting refused; %g s of grace)", len(worker.running),
                     worker.jobs.qsize(), options.shutdown_grace_s)
            worker.drain(options.shutdown_grace_s)

    app.state.drain = drain

    async def _known(_request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    # the errors a client causes or is told about: answered, not logged as server faults
    for kind in (ApiError, ConfigError, NotFound, Conflict, Busy, ShuttingDown, DeadlineExceeded, StoreUnavailable):
        app.add_exception_handler(kind, _known)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes (404) and methods (405) in OpenAI's error shape."""
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message, "invalid_request_error", None, code,
                        dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _any_error(_request: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()  # a fault of the server: the client gets a bounded message

    def owner(request: Request) -> str | None:
        return authorize(request, options.api_keys)

    async def read_json(request: Request, required: bool = True) -> object:
        return await read_body(request, options.max_body_bytes, required)

    async def run(fn, track: RequestTrack | None = None):
        """Run ``fn(job)`` on the worker and wait for it; errors come back as API errors."""
        assert worker is not None
        job = worker.submit(fn, options.request_timeout_s)
        if track is not None:
            track.job = job
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise

    if options.docs:
        from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> dict:
            owner(request)
            return app.openapi()

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request):
            owner(request)
            return get_swagger_ui_html(openapi_url="/openapi.json", title="snapkv-sessions")

        @app.get("/redoc", include_in_schema=False)
        async def redoc(request: Request):
            owner(request)
            return get_redoc_html(openapi_url="/openapi.json", title="snapkv-sessions")

    # ------------------------------------------------------------------ operators (docs/operations.md)

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the process answers. No lock, no store, no model: a long turn never delays it."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 once the model is loaded and the app started, while the store answers and the server
        is not draining; else 503 with the reason (``starting``, ``draining``, ``store_unreachable``)."""
        reason = None
        if worker is None:
            reason = "starting"
        elif worker.closing:
            reason = "draining"
        else:
            try:  # on a thread: the store may take up to its pool timeout to answer, the event loop must not wait
                await asyncio.wait_for(asyncio.to_thread(service.store.ping), service.store.pool_timeout_s + 1)
            except Exception:  # noqa: BLE001 - whatever the store says, the answer is "not ready"
                reason = "store_unreachable"
        if reason is not None:
            return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "model": service.model_name})

    @app.get("/metrics")
    async def scrape(request: Request) -> Response:
        if options.metrics_need_key:
            owner(request)
        if not options.metrics:
            raise ApiError(404, "metrics are off on this server (serve --no-metrics)", "invalid_request_error", None,
                           "metrics_off")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        owner(request)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "snapkv-sessions"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        track = RequestTrack()
        try:
            who = owner(request)
            req = protocol.parse(await read_json(request), options.max_messages)
            if options.log_content and LOG_SCOPE in request.scope:
                request.scope[LOG_SCOPE]["content"] = content_view(req)
            track.stream = bool(req.stream)
            turn = service.prepare(req, who, request.headers.get(SESSION_HEADER))
            if req.stream:
                return await _stream(request, req, turn, track)  # the stream's own end is tracked inside it
            out: TurnOutput = await run(lambda job: service.chat(turn, job, track.first_piece), track)
        except BaseException as exc:  # the client is answered with it (or left: CancelledError); counted first
            track.failed(exc)
            raise
        track.reply_done()
        track.ok(out)
        return JSONResponse(completion_body(out, req.model), headers={SESSION_HEADER: out.session_id})

    async def _stream(request: Request, req: protocol.ChatCompletionRequest, turn: TurnRequest, track: RequestTrack):
        assert worker is not None
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        ready: asyncio.Future[str] = loop.create_future()  # the session that serves the turn, once it runs

        def emit(text: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, text)

        def resolved(session_id: str) -> None:
            track.first_piece()
            loop.call_soon_threadsafe(lambda: ready.done() or ready.set_result(session_id))

        def work(job: Job) -> TurnOutput | None:
            return service.stream(turn, job, emit, resolved)

        job = worker.submit(work, options.request_timeout_s)  # a full queue is a 429 before the stream opens
        track.job = job
        # the end of the pieces, however the job ends (also when the worker never ran it: deadline, shutdown)
        job.future.add_done_callback(lambda _f: loop.call_soon_threadsafe(pieces.put_nowait, None))
        done = asyncio.wrap_future(job.future)
        try:
            # the session, every check and the turn's prefill decide the status: 404, 409, 400, 503 come as such
            await asyncio.wait([ready, done], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if not ready.done():
            exc = done.exception()
            if exc is not None:
                raise exc
            if done.result() is None:  # stopped before its first piece (deadline, shutdown): not a 200
                raise job.stopped()
        cid = protocol.completion_id()

        async def events() -> AsyncIterator[str]:
            try:
                yield json.dumps(protocol.chunk(cid, req.model, {"role": "assistant", "content": ""}))
                while (text := await pieces.get()) is not None:
                    yield json.dumps(protocol.chunk(cid, req.model, {"content": text}))
                try:
                    out = await done
                    if out is None:  # stopped between tokens (deadline, shutdown): the turn was abandoned
                        raise job.stopped()
                except Exception as exc:  # noqa: BLE001 - the stream is open: the error goes in it
                    err = as_api_error(exc)
                    track.failed(err)
                    yield json.dumps(protocol.error(str(err), err.kind, err.param, err.code))
                    return
                track.reply_done()
                for data in end_chunks(stream_end(out), req, cid):
                    yield data
                track.ok(out)
            finally:
                job.cancelled.set()  # the client left (or the stream ended): a running turn stops and is abandoned
                track.failed(asyncio.CancelledError())  # counts only when nothing above ended it: the client left

        async def sse() -> AsyncIterator[dict]:
            async for data in events():
                yield {"data": data}

        headers = {SESSION_HEADER: ready.result()} if ready.done() else {}
        # the server's own drain ends a stream with an error event; the library must not cut it before that
        return EventSourceResponse(sse(), headers=headers, ping=15, shutdown_grace_period=options.shutdown_grace_s + 5)

    # ------------------------------------------------------------------ sessions

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict:
        who = owner(request)
        return {"object": "list", "data": await run(lambda job: service.sessions(who))}

    @app.get("/v1/sessions/{session_id}")
    async def show_session(session_id: str, request: Request) -> dict:
        who = owner(request)
        return await run(lambda job: service.show(session_id, who))

    @app.post("/v1/sessions/{session_id}/verify")
    async def verify_session(session_id: str, request: Request) -> dict:
        who = owner(request)
        return await run(lambda job: service.verify(session_id, who))

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork_session(session_id: str, request: Request) -> dict:
        who = owner(request)
        body = await read_json(request, required=False)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object such as {\"turn\": 2}", "invalid_request_error",
                           "body", "invalid_value")
        turn = body.get("turn")
        return await run(lambda job: service.fork(session_id, who, turn))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> dict:
        who = owner(request)
        return await run(lambda job: service.delete(session_id, who))

    return app


def _extra(out: TurnOutput) -> dict:
    """Fields beside OpenAI's: the session that served the turn (clients send it back as ``X-Session-Id``)."""
    return {"session_id": out.session_id, "turn": out.reply.turn, "context_tokens": out.reply.context_tokens}


def run_server(app: FastAPI, host: str, port: int, grace_s: float) -> None:
    """uvicorn until SIGTERM or Ctrl-C; the signal first drains the app (``app.state.drain``): waiting requests get
    503 with ``Retry-After``, running turns get ``grace_s`` seconds, then stop cleanly. uvicorn's own graceful
    timeout is longer, so it never has to cut a request (a bare 500 and a traceback).

    The server's lines (one per request, the drain, the stop, and the per-turn and fault records) go through the
    package's loggers: configure them first (``stats.configure_logging``, as ``serve --log-format`` does); when
    nothing did, they are written as text on stderr at INFO."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.drain()
            super().handle_exit(sig, frame)

    if not logging.getLogger(stats.PACKAGE_LOGGER).handlers:  # uvicorn's own lines stay at warning
        stats.configure_logging("INFO", "text")
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=int(grace_s) + 15)
    serial_kernels()  # this thread becomes the event loop's: the model never runs on it
    Draining(config).run()
