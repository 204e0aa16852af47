"""The server as a Ray Serve application: replicas of the engine, session affinity, exact failover from the store.

``snapkv-sessions serve --ray --replicas N`` (or ``serve run`` / ``serve deploy`` with a config file naming
:func:`build`) runs two deployments:

* **Ingress** (one replica, no model): the same OpenAI-compatible routes as the single-process server. It checks a
  request, finds the session it continues with the store's indexes (:class:`~.service.Router`), or names a new one
  (a fresh UUID), and sends the turn to the engine with the session id as Ray Serve's *multiplexed model id*.
* **Engine** (``replicas`` replicas): a :class:`~.service.Service` each, with its model, scheduler and decode slots.
  Ray Serve's multiplexing routes a session to the replica that served it last; a replica keeps its
  ``sessions_per_replica`` most recent sessions (Ray's LRU and the service's live set agree) and a session that
  arrives without its cache (a first visit, or its replica died) is rebuilt exactly from the store.

Shared state is the store (PostgreSQL for several replicas) and its locks (Redis when given, PostgreSQL advisory
locks otherwise): two replicas never run a turn of one session at once. When a replica dies mid-turn the ingress
sends the request again, marked as a retry, to a live replica: a turn the dead one had committed and finished is
answered from the store, one it left pending is answered as the session opens (the store's pending rules), one it
never committed runs. No turn is lost or run twice (``tests/test_ray.py``). Requests and replies cross Ray as JSON
(``orjson``), never pickled.

Everything binds where it is told: :func:`start_local` starts Ray on 127.0.0.1 with usage stats and the dashboard
off.
"""

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"snapkv_sessions.serve.ray needs {exc.name!r}: pip install 'snapkv-sessions[ray]'") from exc

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse

from .. import stats
from ..errors import ConfigError
from ..threads import serial_kernels
from . import protocol
from .app import (
    SESSION_HEADER,
    ApiError,
    RequestLog,
    RequestTrack,
    as_api_error,
    authorize,
    completion_body,
    end_chunks,
    read_body,
    stream_end,
)
from .metrics import PrometheusSink, exposition
from .service import Capacity, Router, Service, at_least
from .worker import DeadlineExceeded, Job

REPLICA_HEADER = "X-Replica"
ATTEMPTS_HEADER = "X-Attempts"  # 2 and more: a replica died and the request was sent again
WIRE = {"request_serialization": "orjson", "response_serialization": "orjson"}  # JSON on the wire, never pickle
RETRIES = 4  # attempts of a request whose replica died; the router learns of a death within a few seconds
HUB = "snapkv-sessions-metrics"  # the named actor holding each engine replica's latest metrics
STALE_PUSHES = 3  # a replica whose metrics are older than this many push periods has gone: its series are dropped


@dataclass(frozen=True)
class RaySpec:
    """One Ray Serve deployment of the server.

    model: the model every replica loads (a bundle or hub name); policy: the policy of new sessions; db: the store's
    SQLAlchemy URL (PostgreSQL for several replicas); redis_url: Redis for locks and hot state (optional).
    replicas: engine replicas; sessions_per_replica: sessions a replica keeps hot (Ray Serve's
    ``max_num_models_per_replica``); batch: decode slots per replica; max_tokens: the reply cap of a request that
    names none; api_keys: bearer keys (empty: local use); request_timeout_s: a request's deadline;
    torch_threads: intra-op threads per replica (None: torch's default); warm_tokens: the document of each
    replica's warm start (:mod:`.warm`; 0: none), served before the replica takes requests; log_format: the
    records of every process (``stats.LogSink``'s turns, faults and tier losses on the replicas, a line per request
    on the ingress); metrics_push_s: the period of each replica's metrics to the ingress's ``GET /metrics``.
    """

    model: str
    db: str
    policy: str | dict | None = None
    redis_url: str | None = None
    replicas: int = 2
    sessions_per_replica: int = 16
    batch: int = 8
    max_tokens: int = 256
    api_keys: tuple[str, ...] = ()
    request_timeout_s: float = 600.0
    torch_threads: int | None = None
    max_body_bytes: int = 8 << 20
    max_messages: int = 1024  # messages one request may carry (as serve --max-messages)
    warm_tokens: int = 0
    log_format: str = "text"  # each process's records on its stderr (Ray keeps them in its log folder): text | json
    metrics_push_s: float = 5.0  # how often each engine replica sends its metrics to the ingress (and after a turn)
    extra_actor_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        at_least(self, {"replicas": 1, "sessions_per_replica": 1, "batch": 0, "max_tokens": 1, "max_messages": 1,
                        "warm_tokens": 0})
        if self.log_format not in ("text", "json"):
            raise ConfigError("log_format", self.log_format, "must be 'text' or 'json'")
        if not isinstance(self.metrics_push_s, (int, float)) or not 0.1 <= self.metrics_push_s <= 3600:
            raise ConfigError("metrics_push_s", self.metrics_push_s, "must be a number of seconds in [0.1, 3600]")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))

    @classmethod
    def coerce(cls, spec: "RaySpec | dict") -> "RaySpec":
        """A spec from itself or from a mapping (a Serve config's ``args``); an unknown key is a clear error."""
        if isinstance(spec, RaySpec):
            return spec
        if not isinstance(spec, dict):
            raise ConfigError("args", type(spec).__name__, "must be a mapping of RaySpec fields")
        known = set(cls.__dataclass_fields__)
        for key in spec:
            if key not in known:
                raise ConfigError(str(key)[:80], spec[key], f"is not a RaySpec field (one of {sorted(known)})")
        for key in ("model", "db"):
            if not isinstance(spec.get(key), str) or not spec[key]:
                raise ConfigError(key, spec.get(key), "is required (a string)")
        return cls(**spec)


def build(spec: RaySpec | dict):
    """The Ray Serve application (ingress bound to the engine replicas); also the builder a Serve config names
    (``import_path: snapkv_sessions.serve.ray:build``, ``args:`` the :class:`RaySpec` fields)."""
    spec = RaySpec.coerce(spec)
    engine = _engine_deployment(spec)
    ingress = _ingress_deployment(spec)
    return ingress.bind(engine.bind(asdict(spec)), asdict(spec))


def start_local(port: int, num_cpus: int | None = None) -> None:
    """Start Ray on this machine bound to 127.0.0.1 (usage stats and the dashboard off) and Serve's HTTP proxy on
    ``127.0.0.1:port``."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus, log_to_driver=False,
                 configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- metrics: each replica's, to the ingress


@ray.remote(num_cpus=0)
class MetricsHub:
    """Each engine replica's latest scrape text (Prometheus' text format), sent by the replica every
    ``metrics_push_s`` and after each turn; the ingress's ``GET /metrics`` reads them. Ray Serve gives no way to
    call every replica of a deployment, so the replicas push, and a replica silent for :data:`STALE_PUSHES`
    periods (it died, or was scaled down) is left out."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}  # replica -> (when, text)

    def push(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        now = time.monotonic()
        self.texts = {r: (at, t) for r, (at, t) in self.texts.items() if now - at <= max_age_s}
        return {r: t for r, (_at, t) in self.texts.items()}


def _hub():
    """The app's metrics hub, created by whichever process asks first (detached: it outlives a replica that dies,
    and goes with the Ray cluster)."""
    return MetricsHub.options(name=HUB, get_if_exists=True, lifetime="detached").remote()


# ---------------------------------------------------------------------- the engine replicas


def _engine_deployment(spec: RaySpec):
    @serve.deployment(name="Engine", num_replicas=spec.replicas, max_ongoing_requests=max(spec.batch, 1) * 2,
                      ray_actor_options={"num_cpus": 0, **spec.extra_actor_options})
    class Engine:
        """One replica: a model, its scheduler and slots, its live sessions."""

        def __init__(self, raw: dict) -> None:
            self.spec = RaySpec.coerce(raw)
            if self.spec.torch_threads:
                import torch

                torch.set_num_threads(self.spec.torch_threads)
            from ..store import SessionStore

            store = SessionStore(self.spec.db, redis_url=self.spec.redis_url)
            capacity = Capacity(max_live=self.spec.sessions_per_replica, max_tokens=self.spec.max_tokens,
                                batch=self.spec.batch)
            self.service = Service(self.spec.model, self.spec.policy, store, capacity)
            if self.spec.warm_tokens:
                self.service.warm(self.spec.warm_tokens)
            if self.service.scheduler is not None:  # the model runs on the scheduler's thread: this one loaded it,
                serial_kernels()  # and a team it keeps would make that thread's every parallel op sleep and wake
            self.name = serve.get_replica_context().replica_id.to_full_id_str()
            # this process's metrics and records, registered after the warm start (not counted, as in serve)
            stats.configure_logging("INFO", self.spec.log_format)
            self.metrics = PrometheusSink(self.service.model_name, self.service.scheduler.pool.size
                                          if self.service.scheduler is not None else 0)
            stats.add_sink(self.metrics)
            stats.add_sink(stats.LogSink())
            self.hub = _hub()
            self._push()
            threading.Thread(target=self._push_every, daemon=True, name="metrics-push").start()

        def _push(self):
            """This replica's metrics to the hub (fire and forget: a turn never waits on it); the call's ref."""
            from prometheus_client import generate_latest

            return self.hub.push.remote(self.name, generate_latest(self.metrics.registry).decode())

        def _push_every(self) -> None:
            """The periodic push, which waits for the hub's answer: a hub that died is made again."""
            while True:
                time.sleep(self.spec.metrics_push_s)
                try:
                    ray.get(self._push(), timeout=30)
                except Exception:  # noqa: BLE001 - the hub went away: the pushes go on to a new one
                    with contextlib.suppress(Exception):  # Ray itself may be stopping: the next period tries again
                        self.hub = _hub()

        @serve.multiplexed(max_num_models_per_replica=spec.sessions_per_replica)
        async def session(self, session_id: str) -> str:
            """Ray Serve's affinity marker for a session: the router sends its requests here while it is listed.
            The session itself is opened (rebuilt from the store) by the turn that needs it."""
            return session_id

        async def _prepare(self, call: dict):
            session_id = serve.get_multiplexed_model_id()
            await self.session(session_id)
            req = protocol.parse(call["body"], self.spec.max_messages)
            turn = self.service.prepare(req, call["owner"], session_id)
            turn.create, turn.retried = bool(call["create"]), bool(call["retried"])
            return req, turn, Job(lambda _job: None, time.monotonic() + self.spec.request_timeout_s)

        async def turn(self, call: dict) -> dict:
            """One turn: ``call`` holds the request's JSON body, the owner, and the routing the ingress chose."""
            try:
                req, turn, job = await self._prepare(call)
                out = await asyncio.to_thread(self.service.chat, turn, job)
            except Exception as exc:  # noqa: BLE001 - the ingress answers it as the single-process server would
                return {"error": _error(exc), "replica": self.name}
            finally:
                self._push()
            return {"completion": completion_body(out, req.model), "session_id": out.session_id,
                    "replica": self.name}

        async def turn_stream(self, call: dict):
            """One streamed turn: ``{"replica"}`` first, then ``{"piece"}`` items, then ``{"end"}``
            (:func:`~.app.stream_end`) or ``{"error"}``. Closed early (the client left), its turn is abandoned."""
            yield {"replica": self.name}
            loop, pieces = asyncio.get_running_loop(), asyncio.Queue()
            try:
                req, turn, job = await self._prepare(call)
            except Exception as exc:  # noqa: BLE001 - as above
                yield {"error": _error(exc)}
                return

            def emit(text: str) -> None:
                loop.call_soon_threadsafe(pieces.put_nowait, {"piece": text})

            async def run() -> None:
                try:
                    out = await asyncio.to_thread(self.service.stream, turn, job, emit)
                    end = {"end": stream_end(out)} if out is not None else {"error": _error(TimeoutError())}
                except Exception as exc:  # noqa: BLE001 - as above
                    end = {"error": _error(exc)}
                await pieces.put(end)

            task = asyncio.create_task(run())
            try:
                while True:
                    item = await pieces.get()
                    yield item
                    if "piece" not in item:
                        return
            finally:
                job.cancelled.set()  # a stream left early stops its turn, which is then abandoned cleanly
                await asyncio.shield(task)
                self._push()

    return Engine


def _error(exc: BaseException) -> dict:
    """A replica's failure as data for the ingress (:func:`_response`)."""
    if isinstance(exc, TimeoutError):
        exc = DeadlineExceeded("the request ran past its deadline; its turn was abandoned")
    err = as_api_error(exc)
    return {"status": err.status, "message": str(err), "kind": err.kind, "param": err.param, "code": err.code}


def _response(err: dict, headers: dict) -> JSONResponse:
    """The OpenAI error body of a replica's :func:`_error`."""
    return ApiError(err["status"], err["message"], err["kind"], err["param"], err["code"], headers).response()


DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)  # the replica went away


async def _retrying(start):
    """``await start(attempt)`` until a replica that lives answers (at most :data:`RETRIES` attempts, 1 s, 2 s, ...
    apart, while Ray's router learns of the death); returns its result and the attempts it took."""
    for attempt in range(RETRIES):
        try:
            return await start(attempt), attempt + 1
        except DIED:
            if attempt == RETRIES - 1:
                raise
            await asyncio.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------- the ingress


def _ingress_deployment(spec: RaySpec):
    app = FastAPI(title="snapkv-sessions (Ray Serve)")
    app.add_middleware(RequestLog)  # a record per request, as serve writes them

    @serve.deployment(name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class Ingress:
        """OpenAI-compatible routes; finds each request's session and sends its turn to the engine replicas."""

        def __init__(self, engine, raw: dict) -> None:
            from ..store import SessionStore

            self.spec = RaySpec.coerce(raw)
            self.engine = engine.options(**WIRE)
            self.keys = frozenset(self.spec.api_keys)
            store = SessionStore(self.spec.db, redis_url=self.spec.redis_url)
            self.router = Router(self.spec.model, self.spec.policy, store, self.spec.max_tokens)
            # the requests' metrics (RequestStat, QueueStat) live here; the turns' on each replica (the hub)
            stats.configure_logging("INFO", self.spec.log_format)
            self.metrics = PrometheusSink(self.router.model_name, batch_slots=None)
            stats.add_sink(self.metrics)
            self.hub = _hub()
            self.running = 0

        def _track(self, change: int) -> None:
            """Requests in flight here (``vllm:num_requests_running``; Ray's router queues, not the ingress)."""
            self.running += change
            if stats.active():
                stats.emit(stats.QueueStat(self.running, 0))

        async def _replicas(self) -> dict[str, str]:
            """The live replicas' scrape texts; none when the hub does not answer (a scrape then shows the
            ingress's own metrics, and /ready says no replica, rather than failing)."""
            try:
                return await asyncio.wait_for(self.hub.fresh.remote(STALE_PUSHES * self.spec.metrics_push_s), 10)
            except Exception:  # noqa: BLE001 - the hub died or is slow: the ingress keeps answering
                with contextlib.suppress(Exception):  # Ray itself may be stopping: the next read tries again
                    self.hub = _hub()
                return {}

        @app.get("/health")
        async def health(self) -> JSONResponse:
            """Liveness: the ingress answers (no store, no replica, no lock)."""
            return JSONResponse({"status": "ok"})

        @app.get("/ready")
        async def ready(self) -> JSONResponse:
            """Readiness: 200 while the store answers and at least one engine replica has loaded its model (it
            pushes its metrics once loaded and warm); else 503 with the reason (``store_unreachable``,
            ``no_replica``)."""
            store = self.router.store
            try:
                await asyncio.wait_for(asyncio.to_thread(store.ping), store.pool_timeout_s + 1)
            except Exception:  # noqa: BLE001 - whatever the store says, the answer is "not ready"
                return JSONResponse({"status": "not_ready", "reason": "store_unreachable"}, status_code=503)
            replicas = await self._replicas()
            if not replicas:
                return JSONResponse({"status": "not_ready", "reason": "no_replica"}, status_code=503)
            return JSONResponse({"status": "ready", "model": self.router.model_name, "replicas": len(replicas)})

        @app.get("/metrics")
        async def scrape(self) -> Response:
            """The ingress's request metrics and every live replica's (labelled ``replica``), in one exposition."""
            return Response(exposition(self.metrics.registry, await self._replicas()), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(self, request: Request) -> JSONResponse:
            try:
                authorize(request, self.keys)
            except ApiError as exc:
                return exc.response()
            return JSONResponse({"object": "list", "data": [{"id": self.router.model_name, "object": "model",
                                                             "created": 0, "owned_by": "snapkv-sessions"}]})

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request) -> JSONResponse:
            # one RequestStat per request, as serve emits it; the ingress sees a whole reply at once, so time to
            # first token and per output token are measured on streams only
            track, streaming = RequestTrack(), False
            self._track(+1)
            try:
                owner = authorize(request, self.keys)
                body = await read_body(request, self.spec.max_body_bytes)
                req = protocol.parse(body, self.spec.max_messages)
                track.stream = bool(req.stream)
                turn = self.router.prepare(req, owner, request.headers.get(SESSION_HEADER))
                session_id, create = await asyncio.to_thread(self._route, turn)
                call = {"body": body, "owner": owner, "create": create}
                if req.stream:
                    response = await self._stream(call, session_id, req, track)
                    streaming = isinstance(response, EventSourceResponse)  # the stream ends the track itself
                    return response
                reply = await self._send(call, session_id)
            except Exception as exc:  # noqa: BLE001 - every failure is an OpenAI error body
                track.failed(exc)
                return as_api_error(exc).response()
            finally:
                if not streaming:
                    self._track(-1)
            headers = {SESSION_HEADER: session_id, REPLICA_HEADER: reply["replica"],
                       ATTEMPTS_HEADER: str(reply["attempts"])}
            if "error" in reply:
                track.refused(reply["error"]["status"], reply["error"]["code"] or reply["error"]["kind"])
                return _response(reply["error"], headers)
            done = reply["completion"]
            track.answered(done["choices"][0]["finish_reason"], done["usage"]["prompt_tokens"],
                           done["usage"]["completion_tokens"])
            return JSONResponse(done, headers=headers)

        def _route(self, turn) -> tuple[str, bool]:
            """The session id the turn goes to, and whether it is a new one the engine creates under that id."""
            if turn.session_id is not None:
                self.router._owned(turn.session_id, turn.owner)
                return turn.session_id, False
            found = self.router.continued(turn)
            if found.session_id is not None:
                return found.session_id, False
            return str(uuid.uuid4()), True

        async def _stream(self, call: dict, session_id: str, req, track: RequestTrack):
            """A streamed turn as SSE. A replica that dies before the turn's first piece is retried as
            :meth:`_send` does; one that dies after it ends the stream with an error (the client saw a partial
            reply; sending the whole conversation again continues the session from what the store holds)."""
            async def start(attempt: int):
                items = self.engine.options(multiplexed_model_id=session_id, stream=True).turn_stream.remote(
                    {**call, "retried": attempt > 0})
                head = await items.__anext__()  # {"replica"}: the replica took the turn
                return items, head, await items.__anext__()

            (items, head, first), attempts = await _retrying(start)
            headers = {SESSION_HEADER: session_id, REPLICA_HEADER: head["replica"], ATTEMPTS_HEADER: str(attempts)}
            if "error" in first:
                track.refused(first["error"]["status"], first["error"]["code"] or first["error"]["kind"])
                return _response(first["error"], headers)
            cid = protocol.completion_id()

            async def events():
                yield {"data": json.dumps(protocol.chunk(cid, req.model, {"role": "assistant", "content": ""}))}
                item = first
                try:
                    while True:
                        if "piece" in item:
                            track.first_piece()
                            yield {"data": json.dumps(protocol.chunk(cid, req.model, {"content": item["piece"]}))}
                        elif "end" in item:
                            end = item["end"]
                            track.reply_done()
                            for data in end_chunks(end, req, cid):
                                yield {"data": data}
                            track.answered(end["finish"], end["usage"]["prompt_tokens"],
                                           end["usage"]["completion_tokens"])
                            return
                        else:
                            err = item["error"]
                            yield {"data": json.dumps(protocol.error(err["message"], err["kind"]))}
                            track.refused(err["status"], err["code"] or err["kind"])
                            return
                        item = await items.__anext__()
                except (*DIED, StopAsyncIteration):
                    yield {"data": json.dumps(protocol.error("the replica serving this turn stopped", "server_error"))}
                    track.refused(500, "replica_stopped")
                finally:
                    items.cancel()  # the client left early: the replica's stream closes and abandons the turn
                    track.failed(asyncio.CancelledError())  # counts only when nothing above ended it: the client left
                    self._track(-1)

            return EventSourceResponse(events(), headers=headers, ping=15)

        async def _send(self, call: dict, session_id: str) -> dict:
            """The turn on the replica that holds the session; when that replica dies, again (as a retry) on one
            that lives, which answers from the store what the dead one did."""
            engine = self.engine.options(multiplexed_model_id=session_id)
            reply, attempts = await _retrying(lambda attempt: engine.turn.remote({**call, "retried": attempt > 0}))
            return {**reply, "attempts": attempts}

    return Ingress
