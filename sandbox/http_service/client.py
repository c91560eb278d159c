"""Client of `python -m sandbox serve` (http_service/api.py): the same `run` / `run_many` as LocalSandbox,
executed by a sandbox service on another host.

    async with HTTPSandbox("http://HOST:8088") as sb:       # token: $SANDBOX_TOKEN, as the server
        res = await sb.run("print(1 + 1)", stdin="", timeout=5.0)

A call the service cannot take (unreachable, restarting, 503 past its connection limit) is
retried until `timeout + queue_timeout_s` has passed; then, and for a request the service refuses
(4xx), the call returns an ExecResult with status "internal" and the reason: a tool call never
raises into the agent loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, Iterable

import aiohttp

from sandbox.job_secret import bearer_headers, job_secret
from sandbox.result import ExecResult, Limits, validate_request


# A stateless call may be sent again after any failure to get its answer (restarting or
# unreachable service, a dropped connection, an unreadable answer); a session's cell may not.
RESENDABLE = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)


def _refused(status: int, answer) -> str:
    return (f"sandbox service refused the call: HTTP {status} "
            f"{answer.get('error', answer) if isinstance(answer, dict) else answer}")


class HTTPSandbox:
    def __init__(self, url: str, *, token: str | None = None, default_timeout: float = 5.0,
                 queue_timeout_s: float = 300.0, max_timeout_s: float = Limits().max_timeout_s):
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("SANDBOX_TOKEN") or job_secret()
        self.default_timeout = default_timeout
        self.queue_timeout_s = queue_timeout_s
        self.max_timeout_s = max_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "HTTPSandbox":
        headers = bearer_headers(self.token)
        # one pooled session; no client-side total timeout (each call has its own deadline)
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                              connector=aiohttp.TCPConnector(limit=256))
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        timeout = validate_request(code, stdin, timeout, default_timeout=self.default_timeout,
                                   max_timeout=self.max_timeout_s)
        try:
            status, body = await self._post("/run", {"code": code, "stdin": stdin, "timeout": timeout},
                                            timeout + self.queue_timeout_s, resend=RESENDABLE)
        except ConnectionError as e:
            return ExecResult.internal(str(e))
        if status == 200:
            return ExecResult.from_dict(body)
        return ExecResult.internal(_refused(status, body))  # a refused request does not get better by retrying

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.run(r["code"], r.get("stdin", ""), r.get("timeout"))
                                           for r in requests)))

    async def session(self) -> "HTTPSession":
        """A live interpreter on the service for one trajectory (as LocalSandbox.session)."""
        session = HTTPSession(self)
        await session._open()
        return session

    async def _post(self, path: str, body: dict | None, wait_s: float, *, method: str = "POST",
                    resend=(aiohttp.ClientConnectorError,)) -> tuple[int, Any]:
        """One request, retried while the service cannot take it (503 past its connection limit,
        or one of `resend`: by default only a request that never reached the service, which is
        safe for a session's cell) until wait_s has passed; (status, JSON body). Raises
        ConnectionError then."""
        if self._session is None:
            raise RuntimeError("use HTTPSandbox as `async with HTTPSandbox(url) as sb`")
        deadline = time.monotonic() + wait_s
        last_error = "no attempt"
        while time.monotonic() < deadline:
            try:
                wait = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
                async with self._session.request(method, f"{self.url}{path}", json=body, timeout=wait) as resp:
                    answer = await resp.json(content_type=None)
                    if resp.status != 503 or "too many connections" not in str(answer):
                        return resp.status, answer
                    last_error = "HTTP 503 (busy)"
            except resend as e:
                last_error = repr(e)
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise ConnectionError(f"no result from {self.url}{path} within {wait_s:.0f} s ({last_error})")


class HTTPSession:
    """A session on a `python -m sandbox serve` service: `run` / `close` as sandbox.Session.

    If the service lost the interpreter (it restarted, or the session expired while idle), the next
    call opens a new one and says so in its stderr, as a local session does after a restart. A call
    the service never answered returns status "internal" (it may or may not have run: the cell is
    not sent twice)."""

    def __init__(self, sb: HTTPSandbox):
        self._sb = sb
        self.id: str | None = None
        self.closed = False
        self.restarts = 0

    async def __aenter__(self) -> "HTTPSession":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _open(self):
        status, answer = await self._sb._post("/session", None, self._sb.queue_timeout_s)
        if status != 200:
            raise RuntimeError(f"the sandbox service could not open a session: {_refused(status, answer)}")
        self.id = answer["session"]

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        timeout = validate_request(code, stdin, timeout, default_timeout=self._sb.default_timeout,
                                   max_timeout=self._sb.max_timeout_s)
        if self.closed:
            raise RuntimeError("the session is closed")
        note = ""
        try:
            for _ in range(2):
                status, answer = await self._sb._post(f"/session/{self.id}/run",
                                                      {"code": code, "stdin": stdin, "timeout": timeout},
                                                      timeout + self._sb.queue_timeout_s)
                if status == 404:  # the service lost it: a fresh interpreter, and the result says so
                    await self._open()
                    self.restarts += 1
                    note = "[the sandbox service lost this session: its earlier variables are gone]\n"
                    continue
                if status != 200:
                    return ExecResult.internal(_refused(status, answer))
                result = ExecResult.from_dict(answer)
                return dataclasses.replace(result, stderr=note + result.stderr) if note else result
        except (ConnectionError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, RuntimeError) as e:
            return ExecResult.internal(f"the sandbox service did not answer this session's call: {e!r}")
        return ExecResult.internal("the sandbox service lost this session twice in one call")

    async def close(self):
        if self.closed:
            return
        self.closed = True
        if self.id is not None:
            try:
                await self._sb._post(f"/session/{self.id}", None, 10.0, method="DELETE")
            except (ConnectionError, aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass  # the service's idle timeout frees it
