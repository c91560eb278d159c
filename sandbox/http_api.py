"""HTTP API over a LocalSandbox or RedisSandbox, served by aiohttp.

Native:
  POST /run        {"code", "stdin"?, "timeout"?}      -> ExecResult as JSON
  POST /run/batch  {"requests": [{...}, ...]}         -> {"results": [...]} in request order
  GET  /health (with what isolation is active), GET /metrics (Prometheus text)
code-judge compatible (rStar2-Agent's tool client and verl setups work unchanged):
  POST /run, /judge               {"type": "python", "solution", "input"?, "expected_output"?}
  POST /run/batch, /run/long-batch, /judge/batch   {"type": "batch", "submissions": [...]}
  GET  /status, GET /ping
A body with "solution" instead of "code" is read as code-judge's. Bad requests get a 4xx with a
message and never reach a worker.

Limits: body size (413), batch size (400), connections (503 past `max_connections`), idle and
body-read timeouts; a client that goes away has its batch's calls cancelled (queued ones never
run, running ones are killed). With `token`, every route but /ping needs
`Authorization: Bearer <token>`; a non-loopback address is refused without one.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from sandbox.result import ExecResult, validate_request

log = logging.getLogger("sandbox.http")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GETS = {"/health", "/metrics", "/status", "/ping"}
POSTS = {"/run", "/run/batch", "/run/long-batch", "/judge", "/judge/batch"}
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
    connecting) until its request is read, at most `timeout_s`; otherwise the connection is
    closed. aiohttp times out idle connections between requests, not slow heads or bodies."""

    def __init__(self, inner, timeout_s, connections):
        self.inner, self.timeout_s, self.connections = inner, timeout_s, connections
        self.timer = None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        self.connections[transport] = self
        self.arm()
        self.inner.connection_made(transport)

    def arm(self):
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.timeout_s, self.transport.abort)

    def request_read(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def data_received(self, data):
        self.arm()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.request_read()
        self.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Metrics:
    def __init__(self):
        self.in_flight = 0
        self.by_status: dict[str, int] = {}
        self.bucket_counts = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.bad_requests = 0
        self.cancelled = 0             # calls whose client went away
        self.refused_connections = 0   # connections past max_connections

    def observe(self, result: ExecResult, seconds: float):
        self.by_status[result.status] = self.by_status.get(result.status, 0) + 1
        self.latency_sum += seconds
        self.latency_count += 1
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1

    def render(self, queue_depth: int) -> str:
        lines = ["# HELP sandbox_queue_depth Calls waiting for a worker.", "# TYPE sandbox_queue_depth gauge",
                 f"sandbox_queue_depth {queue_depth}",
                 "# HELP sandbox_in_flight Calls accepted and not yet answered.", "# TYPE sandbox_in_flight gauge",
                 f"sandbox_in_flight {self.in_flight}",
                 "# HELP sandbox_results_total Results by status.", "# TYPE sandbox_results_total counter"]
        lines += [f'sandbox_results_total{{status="{s}"}} {n}' for s, n in sorted(self.by_status.items())]
        lines += ["# HELP sandbox_bad_requests_total Requests rejected with a 4xx.",
                  "# TYPE sandbox_bad_requests_total counter", f"sandbox_bad_requests_total {self.bad_requests}",
                  "# HELP sandbox_cancelled_total Calls cancelled because their client went away.",
                  "# TYPE sandbox_cancelled_total counter", f"sandbox_cancelled_total {self.cancelled}",
                  "# HELP sandbox_refused_connections_total Connections refused past the limit.",
                  "# TYPE sandbox_refused_connections_total counter",
                  f"sandbox_refused_connections_total {self.refused_connections}",
                  "# HELP sandbox_latency_seconds Time from request to result.",
                  "# TYPE sandbox_latency_seconds histogram"]
        lines += [f'sandbox_latency_seconds_bucket{{le="{b}"}} {n}' for b, n in zip(LATENCY_BUCKETS, self.bucket_counts)]
        lines += [f'sandbox_latency_seconds_bucket{{le="+Inf"}} {self.latency_count}',
                  f"sandbox_latency_seconds_sum {self.latency_sum}", f"sandbox_latency_seconds_count {self.latency_count}"]
        return "\n".join(lines) + "\n"


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
                 max_body_bytes: int = 16 << 20, max_batch: int = 100_000, workers: int | None = None,
                 max_connections: int = 1024, read_timeout_s: float = 30.0, idle_timeout_s: float = 75.0,
                 token: str | None = None):
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
        self.metrics = Metrics()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._deadlines: dict[asyncio.BaseTransport, _Deadline] = {}

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
                self.metrics.refused_connections += 1
                return _Refuse()
            return _Deadline(protocol(), self.read_timeout_s, self._deadlines)

        self._server = await asyncio.get_running_loop().create_server(factory, host, port, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def close(self):
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # -------------------------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        try:
            if self.token and request.path != "/ping":
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                    raise HTTPError(401, "missing or wrong bearer token")
            body = None
            if request.method == "POST":
                try:
                    raw = await asyncio.wait_for(request.read(), self.read_timeout_s)
                except asyncio.TimeoutError:
                    raise HTTPError(408, f"the body did not arrive within {self.read_timeout_s} s") from None
                except web.HTTPRequestEntityTooLarge:
                    raise HTTPError(413, f"body is over the {self.max_body_bytes}-byte limit") from None
                try:
                    body = json.loads(raw) if raw else None
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    where = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
                    raise HTTPError(400, f"invalid JSON body: {where}") from None
            self._request_read(request)
            status, kind, payload = await self._route(request.method, request.path, body)
        except HTTPError as e:
            self.metrics.bad_requests += 1
            status, kind, payload = e.status, "json", {"error": str(e)}
        if kind == "json":
            return web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json")
        return web.Response(status=status, text=payload, content_type="text/plain")

    def _request_read(self, request):
        deadline = self._deadlines.get(request.transport)
        if deadline is not None:
            deadline.request_read()

    async def _run(self, code, stdin, timeout) -> ExecResult:
        self.metrics.in_flight += 1
        start = time.monotonic()
        try:
            result = await self.backend.run(code, stdin, timeout)
        except asyncio.CancelledError:
            self.metrics.cancelled += 1
            raise
        finally:
            self.metrics.in_flight -= 1
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

    async def _judge_one(self, sub: dict, *, with_output: bool) -> dict:
        code, stdin, expected, invalid = self._judge_args(sub)
        sub_id = str(sub.get("sub_id") or uuid.uuid4())
        if invalid:
            return {"sub_id": sub_id, "success": False, "run_success": False, "cost": 0.0,
                    "reason": "invalid_input", **({"stdout": "", "stderr": invalid} if with_output else {})}
        result = await self._run(code, stdin, self.default_timeout)
        return code_judge_result(sub_id, result, expected, with_output=with_output)

    async def _route(self, method: str, path: str, body: Any) -> tuple[int, str, Any]:
        path = path.rstrip("/") or "/"
        if path not in GETS | POSTS:
            raise HTTPError(404, f"no route {path}")
        if (method == "GET") != (path in GETS) or method not in ("GET", "POST"):
            raise HTTPError(405, f"{method} not allowed on {path}")
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
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        if path in ("/run", "/judge"):
            if "solution" in body or path == "/judge":
                return 200, "json", await self._judge_one(body, with_output=path == "/run")
            code, stdin, timeout = self._native_args(body)
            return 200, "json", (await self._run(code, stdin, timeout)).to_dict()
        # batches: every request is checked before any runs
        if "submissions" in body:
            subs = body["submissions"]
            if not isinstance(subs, list) or not subs or len(subs) > self.max_batch:
                raise HTTPError(400, f"'submissions' must be a list of 1..{self.max_batch} submissions")
            for sub in subs:
                self._judge_args(sub)
            results = await asyncio.gather(*(self._judge_one(s, with_output=path != "/judge/batch") for s in subs))
            return 200, "json", {"sub_id": str(body.get("sub_id") or uuid.uuid4()), "results": list(results)}
        reqs = body.get("requests")
        if not isinstance(reqs, list) or len(reqs) > self.max_batch:
            raise HTTPError(400, f"'requests' must be a list of at most {self.max_batch} requests")
        args = [self._native_args(r) for r in reqs]
        results = await asyncio.gather(*(self._run(*a) for a in args))
        return 200, "json", {"results": [r.to_dict() for r in results]}

    async def _queue_depth(self) -> int:
        depth = getattr(self.backend, "queue_depth", None)
        if depth is not None:
            return await depth()
        return max(0, self.metrics.in_flight - getattr(self.backend, "workers", 0))
