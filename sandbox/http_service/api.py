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
import json
import logging
import secrets
import time
import uuid
from typing import Any

from aiohttp import web

from sandbox.http_service.guards import FairTurns, HTTPError, ReadDeadline, RefuseConnection, parse_body
from sandbox.job_secret import authorised, check_open_service
from sandbox.http_service.metrics import Metrics
from sandbox.result import ExecResult, Limits, validate_request

log = logging.getLogger("sandbox.http")
GETS = {"/health", "/metrics", "/status", "/ping"}
POSTS = {"/run", "/run/batch", "/run/long-batch", "/judge", "/judge/batch", "/judge/long-batch"}
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


# The longest a byte of a call's output can become in the answer: a control character is a
# six-byte escape ("\u0001"); an undecodable byte becomes U+FFFD, 3 bytes of UTF-8 (ensure_ascii
# is off); anything else is at most its own bytes. Notes the sandbox appends to stderr (a status's
# reason, the session's) and the result's other fields are bounded by RESULT_OVERHEAD_BYTES.
ESCAPED_BYTES_PER_BYTE = 6
RESULT_OVERHEAD_BYTES = 2048


def worst_result_bytes(limits: Limits) -> int:
    """The most one call's result can serialise to (counted on the bytes sent: issue 79)."""
    return ESCAPED_BYTES_PER_BYTE * (limits.stdout_bytes + limits.stderr_bytes) + RESULT_OVERHEAD_BYTES


class SandboxHTTPServer:
    def __init__(self, backend, *, default_timeout: float = 10.0, max_timeout: float = 300.0,
                 max_body_bytes: int = 16 << 20, max_batch: int = 1024, workers: int | None = None,
                 max_connections: int = 1024, read_timeout_s: float = 30.0, idle_timeout_s: float = 75.0,
                 token: str | None = None, auth_timeout_s: float = 5.0, max_response_bytes: int = 1 << 30,
                 write_timeout_s: float = 30.0):
        """max_response_bytes: the most a batch's answer may hold in the worst case (worst_result_bytes
        a call: every call at its stdout and stderr caps, each byte serialised as its longest
        JSON escape); a batch that could exceed it is refused before it runs. The default batch
        (1,024 calls) fits the default budget (1 GiB) at the default caps."""
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
        self.worst_result_bytes = worst_result_bytes(limits)
        self.turns = FairTurns(workers or (1 << 30))  # Redis: its queue orders the calls
        self.metrics = Metrics()
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._deadlines: dict[asyncio.BaseTransport, ReadDeadline] = {}
        self._sessions: dict[str, Any] = {}  # id -> the backend's Session

    async def start(self, host: str = "127.0.0.1", port: int = 8088) -> int:
        # the sandbox runs arbitrary code for whoever can reach it
        check_open_service("the sandbox HTTP service", host, self.token)
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
                    return RefuseConnection()
                self.metrics.count("evicted_connections")
                self._deadlines.pop(idle.transport, None)
                idle.transport.abort()
            return ReadDeadline(protocol(), self.read_timeout_s, self._deadlines,
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
                if not authorised(request.headers.get("Authorization"), self.token):
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
