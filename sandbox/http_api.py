"""HTTP API over a LocalSandbox or RedisSandbox, served by aiohttp.

Native:
  POST /run        {"code", "stdin"?, "timeout"?}      -> ExecResult as JSON
  POST /run/batch  {"requests": [{...}, ...]}         -> {"results": [...]} in request order
  GET  /health (with what isolation is active), GET /metrics (Prometheus text, prometheus_client)
Sessions (a live interpreter per trajectory; over a LocalSandbox or a RedisSandbox):
  POST   /session           {}                                   -> {"session": id}
  POST   /session/<id>/run  {"code", "stdin"?, "timeout"?}     -> ExecResult as JSON
  DELETE /session/<id>                                          -> {"closed": true}
  An id is unguessable (it is the session's only key); an unknown, closed or idle-expired one is a
  404; at the service's session cap a 503 says so. A cell that ended its interpreter says so in
  its stderr, and the next cell on that id starts a fresh one.
code-judge compatible (rStar2-Agent's tool client and verl setups work unchanged):
  POST /run, /judge               {"type": "python", "solution", "input"?, "expected_output"?}
  POST /run/batch, /run/long-batch, /judge/batch, /judge/long-batch   {"type": "batch", "submissions": [...]}
  (a long batch is served as a batch: calls of different requests already take turns for workers)
  GET  /status, GET /ping
A body with "solution" instead of "code" is read as code-judge's. Bad requests get a 4xx with a
message and never reach a worker.

Limits: body size (413), batch size and the batch's worst-case response size (400), JSON depth
and number length (400: no input gives a 500), connections (503 past `max_connections`), idle and
body-read timeouts (a connection has `read_timeout_s` from its previous response, or its first
byte, until its next request is read: a partial request pipelined behind a whole one is cut
then too); a client that goes away has its batch's calls cancelled (queued ones never
run, running ones are killed). Calls of different requests take turns for the workers (round
robin over requests), so a single call is not queued behind another client's large batch.

With `token`, every route needs `Authorization: Bearer <token>`, checked on the headers before
any body is read (a refused request's connection is closed, its body never read); a non-loopback
address is refused without one. A connection that has not yet made an authorised request has a
short deadline to send its headers (`auth_timeout_s`) and is the first to go when the connection
limit is reached, so connections without the token cannot starve those with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import logging
import secrets
import time
import uuid
from typing import Any

from aiohttp import web

from sandbox.result import ExecResult, Limits, validate_request

log = logging.getLogger("sandbox.http")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GETS = {"/health", "/metrics", "/status", "/ping"}
POSTS = {"/run", "/run/batch", "/run/long-batch", "/judge", "/judge/batch", "/judge/long-batch"}
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 35\r\n"
         b"Connection: close\r\n\r\n{\"error\": \"too many connections\"}\n")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Refuse(asyncio.Protocol):
    """A connection past the limit: one 503, then closed (never reaches aiohttp). It reads what
    the client sent first: closing with unread data would reset the connection and lose the 503."""

    def connection_made(self, transport):
        self.transport = transport
        transport.write(_BUSY)
        self.timer = asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data):
        self.timer.cancel()
        self.transport.close()


class _Deadline(asyncio.Protocol):
    """aiohttp's protocol with a read deadline: from the first byte a client sends (or from
    connecting) until its request is read, at most `timeout_s`, or `auth_timeout_s` while the
    connection has made no authorised request; otherwise the connection is closed. aiohttp times
    out idle connections between requests, not slow heads or bodies."""

    def __init__(self, inner, timeout_s, connections, *, auth_timeout_s=None, write_timeout_s=30.0, metrics=None):
        self.inner, self.timeout_s, self.connections = inner, timeout_s, connections
        self.auth_timeout_s = auth_timeout_s
        self.write_timeout_s, self.metrics = write_timeout_s, metrics
        self.write_timer = None
        self.authenticated = auth_timeout_s is None  # no token: every connection is
        self.timer = None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        self.connections[transport] = self
        self.arm()
        self.inner.connection_made(transport)

    def arm(self):
        if self.timer is None:
            limit = self.timeout_s if self.authenticated else min(self.timeout_s, self.auth_timeout_s)
            self.timer = asyncio.get_running_loop().call_later(limit, self.transport.abort)

    def request_read(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def response_ready(self):
        """The next request's deadline starts now: bytes of it may already be here (pipelined in
        the same packet as this one), and no more may ever come to re-arm it. So a connection
        gets `timeout_s`, not aiohttp's longer keep-alive, to send its next request whole."""
        self.request_read()
        self.arm()

    def data_received(self, data):
        self.arm()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.request_read()
        if self.write_timer is not None:
            self.write_timer.cancel()
        self.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self):
        # the client stopped reading and the send buffer is full: it has write_timeout_s to resume
        if self.write_timer is None:
            self.write_timer = asyncio.get_running_loop().call_later(self.write_timeout_s, self._write_timed_out)
        self.inner.pause_writing()

    def resume_writing(self):
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        self.inner.resume_writing()

    def _write_timed_out(self):
        if self.metrics is not None:
            self.metrics.count("write_timeouts")
        self.transport.abort()  # frees the unsent response at once


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


MAX_NUMBER_CHARS = 100  # a JSON number longer than this is refused (Python's int() of 4,300+ digits raises)


def _bounded_number(text: str):
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return text


def parse_body(raw: bytes):
    """The JSON of a request body; every malformed body is an HTTPError 400 naming why."""
    try:  # UTF-8 only (json.loads of bytes would also take UTF-16 and UTF-32)
        return json.loads(raw.decode("utf-8"), parse_int=lambda t: int(_bounded_number(t)),
                          parse_float=lambda t: float(_bounded_number(t))) if raw else None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"invalid JSON body: line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise HTTPError(400, "invalid JSON body: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise HTTPError(400, f"invalid JSON body: {e}") from None


class FairTurns:
    """At most `capacity` calls at once, granted round robin over requests: each request (key) gets
    one call in before any request gets a second, whatever order they queued in."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.running = 0
        self.queues: collections.OrderedDict[Any, collections.deque] = collections.OrderedDict()

    @contextlib.asynccontextmanager
    async def turn(self, key):
        if self.running < self.capacity and not self.queues:
            self.running += 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            self.queues.setdefault(key, collections.deque()).append(waiter)
            try:
                await waiter  # running was counted for us by whoever handed the turn over
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._release()  # granted as we were cancelled: pass it on
                else:
                    self._forget(key, waiter)
                raise
        try:
            yield
        finally:
            self._release()

    def _forget(self, key, waiter):
        queue = self.queues.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self.queues[key]

    def _release(self):
        self.running -= 1
        while self.queues and self.running < self.capacity:
            key, queue = next(iter(self.queues.items()))
            waiter = queue.popleft()
            del self.queues[key]
            if queue:
                self.queues[key] = queue  # to the back of the rotation
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)


class Metrics:
    """The service's Prometheus metrics, kept by prometheus_client (one registry per server, so
    several servers in one process do not share counters); /metrics is its text exposition.
    Counters are bumped with `count(name)`; reads (`metrics.cancelled`, ...) give their values."""

    COUNTERS = {
        "bad_requests": "Requests rejected with a 4xx.",
        "cancelled": "Calls cancelled because their client went away.",
        "refused_connections": "Connections refused past the limit.",
        "evicted_connections": "Unauthenticated connections closed to admit others.",
        "write_timeouts": "Connections closed because the client stopped reading.",
    }

    def __init__(self):
        import prometheus_client as prom
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self._queue_depth = prom.Gauge("sandbox_queue_depth", "Calls waiting for a worker.", registry=r)
        self._in_flight = prom.Gauge("sandbox_in_flight", "Calls accepted and not yet answered.", registry=r)
        self._results = prom.Counter("sandbox_results", "Results by status.", ["status"], registry=r)
        self._counters = {name: prom.Counter(f"sandbox_{name}", doc, registry=r) for name, doc in self.COUNTERS.items()}
        self._latency = prom.Histogram("sandbox_latency_seconds", "Time from request to result.",
                                       buckets=LATENCY_BUCKETS, registry=r)

    def count(self, name: str):
        self._counters[name].inc()

    def __getattr__(self, name: str) -> int:  # metrics.cancelled, metrics.write_timeouts, ...
        if name in Metrics.COUNTERS:
            return int(self.registry.get_sample_value(f"sandbox_{name}_total") or 0)
        raise AttributeError(name)

    @property
    def in_flight(self) -> int:
        return int(self.registry.get_sample_value("sandbox_in_flight") or 0)

    def call_started(self):
        self._in_flight.inc()

    def call_ended(self):
        self._in_flight.dec()

    def observe(self, result: ExecResult, seconds: float):
        self._results.labels(status=result.status).inc()
        self._latency.observe(seconds)

    def render(self, queue_depth: int) -> str:
        import prometheus_client as prom
        self._queue_depth.set(queue_depth)
        return prom.generate_latest(self.registry).decode()


def code_judge_result(sub_id: str, result: ExecResult, expected_output: str | None, *,
                      with_output: bool = True) -> dict[str, Any]:
    run_success = result.status == "ok"
    success = run_success and (expected_output is None or result.stdout.strip() == expected_output.strip())
    reason = {"timeout": "worker_timeout", "internal": "internal_error"}.get(result.status, "")
    out = {"sub_id": sub_id, "success": success, "run_success": run_success, "cost": result.duration_s,
           "reason": reason}
    if with_output:
        out.update(stdout=result.stdout, stderr=result.stderr)
    return out


class SandboxHTTPServer:
    def __init__(self, backend, *, default_timeout: float = 10.0, max_timeout: float = 300.0,
                 max_body_bytes: int = 16 << 20, max_batch: int = 2048, workers: int | None = None,
                 max_connections: int = 1024, read_timeout_s: float = 30.0, idle_timeout_s: float = 75.0,
                 token: str | None = None, auth_timeout_s: float = 5.0, max_response_bytes: int = 1 << 30,
                 write_timeout_s: float = 30.0):
        """max_response_bytes: the most a batch's answer may hold in the worst case (every call at
        its stdout and stderr caps, 3 bytes per character after replacing undecodable bytes); a
        batch that could exceed it is refused before it runs."""
        self.backend = backend  # LocalSandbox or RedisSandbox: async run(code, stdin, timeout)
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.max_body_bytes = max_body_bytes
        self.max_batch = max_batch
        self.workers = workers
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.token = token
        self.auth_timeout_s = auth_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_response_bytes = max_response_bytes
        limits = getattr(backend, "limits", None) or Limits()
        self.worst_result_bytes = 3 * (limits.stdout_bytes + limits.stderr_bytes) + 512
        self.turns = FairTurns(workers or (1 << 30))  # Redis: its queue orders the calls
        self.metrics = Metrics()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._deadlines: dict[asyncio.BaseTransport, _Deadline] = {}
        self._sessions: dict[str, Any] = {}  # id -> the backend's Session

    async def start(self, host: str = "127.0.0.1", port: int = 8088) -> int:
        if not is_loopback(host) and not self.token:
            raise ValueError(f"refusing to serve on non-loopback address {host!r} without a bearer token "
                             "(the sandbox runs arbitrary code for whoever can reach it): set a token")
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        # handler_cancellation: a client that disconnects cancels its handler, and with it its calls.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     keepalive_timeout=self.idle_timeout_s)
        await self._runner.setup()
        protocol = self._runner.server

        def factory():
            if len(self._deadlines) >= self.max_connections:
                # the oldest connection that has made no authorised request goes (token set)
                idle = next((d for d in self._deadlines.values() if not d.authenticated), None)
                if idle is None:
                    self.metrics.count("refused_connections")
                    return _Refuse()
                self.metrics.count("evicted_connections")
                self._deadlines.pop(idle.transport, None)
                idle.transport.abort()
            return _Deadline(protocol(), self.read_timeout_s, self._deadlines,
                             auth_timeout_s=self.auth_timeout_s if self.token else None,
                             write_timeout_s=self.write_timeout_s, metrics=self.metrics)

        self._server = await asyncio.get_running_loop().create_server(factory, host, port, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def close(self):
        for session in list(self._sessions.values()):
            await session.close()
        self._sessions.clear()
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # -------------------------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body_read = request.method != "POST"
        try:
            if self.token:  # on the headers alone, before anything else
                given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                    raise HTTPError(401, "missing or wrong bearer token")
                deadline = self._deadlines.get(request.transport)
                if deadline is not None:
                    deadline.authenticated = True
            path = request.path.rstrip("/") or "/"
            self._check_route(request.method, path)
            body = None
            if request.method == "POST" or (request.method == "DELETE" and request.can_read_body):
                try:
                    raw = await asyncio.wait_for(request.read(), self.read_timeout_s)
                except asyncio.TimeoutError:
                    raise HTTPError(408, f"the body did not arrive within {self.read_timeout_s} s") from None
                except web.HTTPRequestEntityTooLarge:
                    raise HTTPError(413, f"body is over the {self.max_body_bytes}-byte limit") from None
                body_read = True
                body = parse_body(raw)
            self._request_read(request)
            status, kind, payload = await self._route(request, path, body)
        except HTTPError as e:
            self.metrics.count("bad_requests")
            status, kind, payload = e.status, "json", {"error": str(e)}
        if kind == "json":
            # ensure_ascii=False: a replacement character is 3 bytes of UTF-8, not 6 of "\ufffd". A
            # batch's answer is serialised off the event loop: other clients are not held up.
            encode = lambda: json.dumps(payload, ensure_ascii=False).encode()  # noqa: E731
            big = isinstance(payload, dict) and len(payload.get("results") or ()) > 8
            response = web.Response(status=status, body=await asyncio.to_thread(encode) if big else encode(),
                                    content_type="application/json")
        else:
            response = web.Response(status=status, text=payload, content_type="text/plain")
        if not body_read:  # its body is never read: the connection cannot carry another request
            response.force_close()
        deadline = self._deadlines.get(request.transport)
        if deadline is not None:
            deadline.response_ready()
        return response

    def _check_route(self, method: str, path: str):
        if path == "/session" or path.startswith("/session/"):
            parts = path.split("/")  # ["", "session"] | ["", "session", id] | ["", "session", id, "run"]
            allowed = {2: "POST", 3: "DELETE", 4: "POST"}.get(len(parts))
            if allowed is None or (len(parts) == 4 and parts[3] != "run"):
                raise HTTPError(404, f"no route {path}")
            if method != allowed:
                raise HTTPError(405, f"{method} not allowed on {path}")
            return
        if path not in GETS | POSTS:
            raise HTTPError(404, f"no route {path}")
        if (method == "GET") != (path in GETS) or method not in ("GET", "POST"):
            raise HTTPError(405, f"{method} not allowed on {path}")

    def _request_read(self, request):
        deadline = self._deadlines.get(request.transport)
        if deadline is not None:
            deadline.request_read()

    async def _run(self, code, stdin, timeout, key=None, on=None) -> ExecResult:
        """One call, when its request's turn comes (FairTurns: requests take turns for workers).
        on: a session to run it in (default: a stateless call on the backend)."""
        self.metrics.call_started()
        start = time.monotonic()
        try:
            async with self.turns.turn(key):
                result = await (on or self.backend).run(code, stdin, timeout)
        except asyncio.CancelledError:
            self.metrics.count("cancelled")
            raise
        finally:
            self.metrics.call_ended()
        self.metrics.observe(result, time.monotonic() - start)
        return result

    def _native_args(self, req: Any) -> tuple[str, str, float]:
        if not isinstance(req, dict):
            raise HTTPError(400, "each request must be a JSON object")
        if "code" not in req:
            raise HTTPError(400, "missing field 'code'")
        try:
            timeout = validate_request(req["code"], req.get("stdin", ""), req.get("timeout"),
                                       default_timeout=self.default_timeout, max_timeout=self.max_timeout)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        return req["code"], req.get("stdin", ""), timeout

    def _judge_args(self, sub: Any) -> tuple[str, str, str | None, str | None]:
        """(code, stdin, expected_output, invalid reason or None) of a code-judge submission."""
        if not isinstance(sub, dict) or not isinstance(sub.get("solution"), str):
            raise HTTPError(400, "a code-judge submission needs a string 'solution'")
        stdin = sub.get("input") or ""
        expected = sub.get("expected_output")
        if not isinstance(stdin, str) or not (expected is None or isinstance(expected, str)):
            raise HTTPError(400, "'input' and 'expected_output' must be strings")
        try:
            validate_request(sub["solution"], stdin, None, default_timeout=self.default_timeout,
                             max_timeout=self.max_timeout)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        invalid = None if sub.get("type", "python") == "python" else f"unsupported type {sub.get('type')!r}"
        return sub["solution"], stdin, expected, invalid

    async def _judge_one(self, sub: dict, *, with_output: bool, key=None) -> dict:
        code, stdin, expected, invalid = self._judge_args(sub)
        sub_id = str(sub.get("sub_id") or uuid.uuid4())
        if invalid:
            return {"sub_id": sub_id, "success": False, "run_success": False, "cost": 0.0,
                    "reason": "invalid_input", **({"stdout": "", "stderr": invalid} if with_output else {})}
        result = await self._run(code, stdin, self.default_timeout, key)
        return code_judge_result(sub_id, result, expected, with_output=with_output)

    def _check_batch(self, n: int, what: str):
        if not 1 <= n <= self.max_batch:
            raise HTTPError(400, f"'{what}' must be a list of 1..{self.max_batch} entries, got {n} (at most "
                                 f"{self.max_batch} per request)")
        if n * self.worst_result_bytes > self.max_response_bytes:
            most = max(1, self.max_response_bytes // self.worst_result_bytes)
            raise HTTPError(400, f"a batch of {n} calls may answer up to {n * self.worst_result_bytes} bytes, over the "
                                 f"{self.max_response_bytes}-byte response budget: send at most {most} per request")

    async def _route(self, request, path: str, body: Any) -> tuple[int, str, Any]:
        key = id(request)  # the unit of fairness: one request
        if path == "/health":
            protections = getattr(self.backend, "protections", None)
            return 200, "json", {"status": "ok", "in_flight": self.metrics.in_flight,
                                 **({"protections": protections} if protections is not None else {})}
        if path == "/ping":
            return 200, "json", "pong"
        if path == "/metrics":
            return 200, "text", self.metrics.render(await self._queue_depth())
        if path == "/status":
            return 200, "json", {"queue": await self._queue_depth(), "num_workers": self.workers}
        if path == "/session" or path.startswith("/session/"):
            return await self._session_route(request.method, path.split("/")[2:], body, key)
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        if path in ("/run", "/judge"):
            if "solution" in body or path == "/judge":
                return 200, "json", await self._judge_one(body, with_output=path == "/run", key=key)
            code, stdin, timeout = self._native_args(body)
            return 200, "json", (await self._run(code, stdin, timeout, key)).to_dict()
        # batches: every request is checked before any runs
        if "submissions" in body:
            subs = body["submissions"]
            if not isinstance(subs, list):
                raise HTTPError(400, "'submissions' must be a list")
            self._check_batch(len(subs), "submissions")
            for sub in subs:
                self._judge_args(sub)
            results = await asyncio.gather(*(self._judge_one(s, with_output=not path.startswith("/judge"), key=key)
                                             for s in subs))
            return 200, "json", {"sub_id": str(body.get("sub_id") or uuid.uuid4()), "results": list(results)}
        reqs = body.get("requests")
        if not isinstance(reqs, list):
            raise HTTPError(400, "'requests' must be a list")
        if reqs:
            self._check_batch(len(reqs), "requests")
        args = [self._native_args(r) for r in reqs]
        results = await asyncio.gather(*(self._run(*a, key) for a in args))
        return 200, "json", {"results": [r.to_dict() for r in results]}

    async def _session_route(self, method: str, parts: list[str], body: Any, key) -> tuple[int, str, Any]:
        """parts: [] (open), [id] (DELETE: close), [id, "run"] (a cell)."""
        open_session = getattr(self.backend, "session", None)
        if open_session is None:
            raise HTTPError(501, "this service's backend has no sessions")
        if not parts:
            try:
                session = await open_session()
            except RuntimeError as e:  # at the session cap (SessionLimitError), or no Redis worker could open one
                raise HTTPError(503, str(e)) from None
            session_id = secrets.token_urlsafe(18)
            self._sessions[session_id] = session
            return 200, "json", {"session": session_id}
        session = self._sessions.get(parts[0])
        if session is not None and session.closed:  # closed by the backend (idle timeout, shutdown)
            self._sessions.pop(parts[0], None)
            session = None
        if session is None:
            raise HTTPError(404, "no such session: it was closed, it expired after being idle, or the service "
                                 "restarted; open a new one (POST /session)")
        if method == "DELETE":
            self._sessions.pop(parts[0], None)
            await session.close()
            return 200, "json", {"closed": True}
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        code, stdin, timeout = self._native_args(body)
        return 200, "json", (await self._run(code, stdin, timeout, key, on=session)).to_dict()

    async def _queue_depth(self) -> int:
        depth = getattr(self.backend, "queue_depth", None)
        if depth is not None:
            return await depth()
        return max(0, self.metrics.in_flight - getattr(self.backend, "workers", 0))
