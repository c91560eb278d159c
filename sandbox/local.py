"""LocalSandbox: the embedded asyncio execution pool.

    async with sandbox.LocalSandbox(workers=4) as sb:
        result = await sb.run("print(2 ** 10)")
        results = await sb.run_many([{"code": "1 + 1"}, {"code": "input()", "stdin": "x"}])

isolation="strict" (default) needs root or CAP_SYS_ADMIN (namespaces, uid switch) and refuses to
start without it; isolation="basic" runs with rlimits only and warns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import warnings
from typing import Any, Iterable, Sequence

from sandbox.pool import DEFAULT_PRELOAD, DEFAULT_UID_BASE, SandboxStartError, ZygotePool
from sandbox.result import ExecResult, Limits, validate_request

log = logging.getLogger("sandbox")


def check_strict_isolation_available() -> str | None:
    """None if strict isolation can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "strict isolation needs root (namespaces, a per-call uid); run as root or use isolation='basic'"
    for ns in ("net", "pid", "mnt", "ipc"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            return f"this kernel has no {ns} namespaces; use isolation='basic'"
    return None


ISOLATION_MODES = ("strict", "basic")


class LocalSandbox:
    def __init__(self, workers: int = 4, *, isolation: str = "strict", limits: Limits = Limits(),
                 preload: Sequence[str] = DEFAULT_PRELOAD, default_timeout: float = 5.0,
                 max_pending: int = 4096, uid_base: int = DEFAULT_UID_BASE):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be 'strict' or 'basic', got {isolation!r}")
        self.workers = workers
        self.isolation = isolation
        self.limits = limits
        self.default_timeout = default_timeout
        self._pool = ZygotePool(workers, isolation=isolation, preload=preload, limits=limits, uid_base=uid_base)
        self._pending = asyncio.Semaphore(max_pending)  # backpressure: callers past this wait
        self.in_flight = 0
        self._started = False

    async def start(self) -> "LocalSandbox":
        if self.isolation == "strict":
            reason = check_strict_isolation_available()
            if reason:
                raise SandboxStartError(reason)
        else:
            warnings.warn("sandbox isolation='basic': rlimits only; code can reach the network, "
                          "see other processes and read the filesystem", RuntimeWarning, stacklevel=2)
        await self._pool.start()
        self._started = True
        return self

    async def __aenter__(self) -> "LocalSandbox":
        return await self.start()

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._started:
            self._started = False
            await self._pool.close()

    @property
    def protections(self) -> dict:
        """What the running zygote enforces: isolation, cgroups ("v1" | "v2" | None), seccomp, minimal_root."""
        return dict(self._pool.protections)

    @property
    def zygote_pid(self) -> int | None:
        """PID of the zygote (its /proc/PID/root shows the calls' private /tmp)."""
        return self._pool.zygote_pid

    def validate(self, code: Any, stdin: Any = "", timeout: Any = None) -> float:
        """Check one request; returns the timeout to use. Raises ValueError with the reason."""
        return validate_request(code, stdin, timeout, default_timeout=self.default_timeout,
                                max_timeout=self.limits.max_timeout_s)

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        if not self._started:
            raise RuntimeError("LocalSandbox is not started: use `async with LocalSandbox(...) as sb`")
        timeout = self.validate(code, stdin, timeout)
        async with self._pending:
            self.in_flight += 1
            try:
                return await self._pool.run(code, stdin, timeout)
            finally:
                self.in_flight -= 1

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]:
        """Run requests ({"code", "stdin"?, "timeout"?}) concurrently; results in request order."""
        return list(await asyncio.gather(*(self.run(r["code"], r.get("stdin", ""), r.get("timeout"))
                                           for r in requests)))
