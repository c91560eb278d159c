"""What every sandbox client offers, typed: LocalSandbox (local.py), RedisSandbox
(redis_queue/client.py) and HTTPSandbox (http_service/client.py) are each a `SandboxClient`, and their
sessions (local.Session, RedisSession, HTTPSession) each a `SandboxSession`. Code that runs tool calls (the
trainer's agent loop) is typed against these two and never sees which backend it has."""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

from sandbox.result import ExecResult


@runtime_checkable
class SandboxSession(Protocol):
    """One live interpreter: variables persist from one `run` to the next until `close`."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> SandboxSession: ...

    async def __aexit__(self, *exc) -> Any: ...


@runtime_checkable
class SandboxClient(Protocol):
    """Runs code: one call (`run`), many (`run_many`), or a live interpreter (`session`)."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult: ...

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]: ...

    async def session(self) -> SandboxSession: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> SandboxClient: ...

    async def __aexit__(self, *exc) -> Any: ...
