"""Secure, fast Python execution for tool calls. Usable on its own; imports nothing of rstar2_jax.

    import sandbox
    async with sandbox.LocalSandbox(workers=4) as sb:
        res = await sb.run("print(1 + 1)", stdin="", timeout=5.0)  # -> ExecResult
    async with sandbox.RedisSandbox("redis://HOST:6379/0") as sb:   # `python -m sandbox worker`s elsewhere
        ...
    async with sandbox.HTTPSandbox("http://HOST:8088") as sb:        # `python -m sandbox serve` elsewhere
        ...
"""

from sandbox.client import SandboxClient, SandboxSession
from sandbox.local import ISOLATION_MODES, LocalSandbox, Session, SessionLimitError
from sandbox.pool import SandboxStartError
from sandbox.result import STATUSES, ExecResult, Limits

__all__ = ["ExecResult", "HTTPSandbox", "ISOLATION_MODES", "Limits", "LocalSandbox", "RedisSandbox", "STATUSES",
           "SandboxClient", "SandboxSession", "SandboxStartError", "Session", "SessionLimitError"]


def __getattr__(name):  # the remote clients' libraries (redis, aiohttp) load only for those who use them
    if name == "RedisSandbox":
        from sandbox.redis_client import RedisSandbox
        return RedisSandbox
    if name == "HTTPSandbox":
        from sandbox.http_client import HTTPSandbox
        return HTTPSandbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
