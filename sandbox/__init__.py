"""Secure, fast Python execution for tool calls. Usable on its own; imports nothing of rstar2_jax.

    import sandbox
    async with sandbox.LocalSandbox(workers=4) as sb:
        res = await sb.run("print(1 + 1)", stdin="", timeout=5.0)  # -> ExecResult
    async with sandbox.RedisSandbox("redis://HOST:6379/0") as sb:   # `python -m sandbox worker`s elsewhere
        ...
"""

from sandbox.local import ISOLATION_MODES, LocalSandbox, Session
from sandbox.pool import SandboxStartError
from sandbox.result import STATUSES, ExecResult, Limits

__all__ = ["ExecResult", "ISOLATION_MODES", "Limits", "LocalSandbox", "RedisSandbox", "STATUSES", "SandboxStartError",
           "Session"]


def __getattr__(name):
    if name == "RedisSandbox":  # the Redis client library loads only for those who use it
        from sandbox.distributed import RedisSandbox
        return RedisSandbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
