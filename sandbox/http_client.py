"""Client of `python -m sandbox serve` (http_api.py): the same `run` / `run_many` as LocalSandbox,
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
import os
import time
from typing import Any, Iterable

import aiohttp

from sandbox.result import ExecResult, Limits, validate_request


class HTTPSandbox:
    def __init__(self, url: str, *, token: str | None = None, default_timeout: float = 5.0,
                 queue_timeout_s: float = 300.0, max_timeout_s: float = Limits().max_timeout_s):
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("SANDBOX_TOKEN") or None
        self.default_timeout = default_timeout
        self.queue_timeout_s = queue_timeout_s
        self.max_timeout_s = max_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "HTTPSandbox":
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
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
        if self._session is None:
            raise RuntimeError("use HTTPSandbox as `async with HTTPSandbox(url) as sb`")
        deadline = time.monotonic() + timeout + self.queue_timeout_s
        last_error = "no attempt"
        while time.monotonic() < deadline:
            try:
                wait = aiohttp.ClientTimeout(total=max(1.0, deadline - time.monotonic()))
                async with self._session.post(f"{self.url}/run", json={"code": code, "stdin": stdin,
                                                                       "timeout": timeout}, timeout=wait) as resp:
                    body = await resp.json(content_type=None)
                    if resp.status == 200:
                        return ExecResult.from_dict(body)
                    if resp.status != 503:  # a refused request does not get better by retrying
                        return ExecResult.internal(f"sandbox service refused the call: HTTP {resp.status} "
                                                   f"{body.get('error', body) if isinstance(body, dict) else body}")
                    last_error = "HTTP 503 (busy)"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # restarting or unreachable
                last_error = repr(e)
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return ExecResult.internal(f"no result from {self.url} within {timeout + self.queue_timeout_s:.0f} s "
                                   f"({last_error})")

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.run(r["code"], r.get("stdin", ""), r.get("timeout"))
                                           for r in requests)))
