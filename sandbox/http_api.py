"""HTTP API over a LocalSandbox or RedisSandbox (stdlib asyncio, HTTP/1.1 with keep-alive).

Native:
  POST /run        {"code", "stdin"?, "timeout"?}      -> ExecResult as JSON
  POST /run/batch  {"requests": [{...}, ...]}         -> {"results": [...]} in request order
  GET  /health, GET /metrics (Prometheus text)
code-judge compatible (rStar2-Agent's tool client and verl setups work unchanged):
  POST /run, /judge               {"type": "python", "solution", "input"?, "expected_output"?}
  POST /run/batch, /run/long-batch, /judge/batch   {"type": "batch", "submissions": [...]}
  GET  /status, GET /ping
A body with "solution" instead of "code" is read as code-judge's. Bad requests get a 4xx with a
message and never reach a worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from sandbox.result import ExecResult, validate_request

log = logging.getLogger("sandbox.http")
MAX_HEADER_BYTES = 64 << 10
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            411: "Length Required", 413: "Payload Too Large", 500: "Internal Server Error"}


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
                 max_body_bytes: int = 16 << 20, max_batch: int = 100_000, workers: int | None = None):
        self.backend = backend  # LocalSandbox or RedisSandbox: async run(code, stdin, timeout)
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.max_body_bytes = max_body_bytes
        self.max_batch = max_batch
        self.workers = workers
        self.metrics = Metrics()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 8088) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEADER_BYTES)
        return self._server.sockets[0].getsockname()[1]

    async def close(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -------------------------------------------------------------------------------------------
    async def _run(self, code, stdin, timeout) -> ExecResult:
        self.metrics.in_flight += 1
        start = time.monotonic()
        try:
            result = await self.backend.run(code, stdin, timeout)
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
        path = path.split("?", 1)[0].rstrip("/") or "/"
        gets = {"/health", "/metrics", "/status", "/ping"}
        posts = {"/run", "/run/batch", "/run/long-batch", "/judge", "/judge/batch"}
        if path not in gets | posts:
            raise HTTPError(404, f"no route {path}")
        if (method == "GET") != (path in gets) or method not in ("GET", "POST"):
            raise HTTPError(405, f"{method} not allowed on {path}")
        if path == "/health":
            return 200, "json", {"status": "ok", "in_flight": self.metrics.in_flight}
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
        # batches
        if "submissions" in body:
            subs = body["submissions"]
            if not isinstance(subs, list) or not subs or len(subs) > self.max_batch:
                raise HTTPError(400, f"'submissions' must be a list of 1..{self.max_batch} submissions")
            for sub in subs:
                self._judge_args(sub)  # reject the whole batch before anything runs
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

    # -------------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                keep_alive = await self._one_request(reader, writer)
                if not keep_alive:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader, writer) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            await self._respond(writer, 400, "json", {"error": "malformed request line"}, False)
            return False
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        try:
            body = None
            if method == "POST":
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    raise HTTPError(411, "send a Content-Length (chunked bodies are not accepted)")
                length = int(headers.get("content-length", "0") or 0)
                if length > self.max_body_bytes:
                    await self._discard(reader, length)  # so the client reads our answer, not a reset
                    raise HTTPError(413, f"body of {length} bytes is over the {self.max_body_bytes}-byte limit")
                raw = await reader.readexactly(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError as e:
                    raise HTTPError(400, f"invalid JSON body: line {e.lineno} column {e.colno}: {e.msg}") from None
            status, kind, payload = await self._route(method, target, body)
        except HTTPError as e:
            self.metrics.bad_requests += 1
            status, kind, payload = e.status, "json", {"error": str(e)}
            if e.status == 413:
                keep_alive = False  # the unread body is still on the connection
        except Exception as e:  # noqa: BLE001 - answer, never drop the connection silently
            log.exception("request failed")
            status, kind, payload = 500, "json", {"error": f"internal error: {e!r}"}
        await self._respond(writer, status, kind, payload, keep_alive)
        return keep_alive

    @staticmethod
    async def _discard(reader, length, cap=256 << 20):
        left = min(length, cap)
        while left > 0:
            chunk = await reader.read(min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)

    async def _respond(self, writer, status, kind, payload, keep_alive):
        if kind == "json":
            data, ctype = json.dumps(payload).encode(), "application/json"
        else:
            data, ctype = payload.encode(), "text/plain; version=0.0.4"
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
