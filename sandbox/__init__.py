"""Secure, fast Python execution for tool calls. Usable on its own; imports nothing of rstar2_jax.

    import sandbox
    async with sandbox.LocalSandbox(workers=4) as sb:
        res = await sb.run("print(1 + 1)", stdin="", timeout=5.0)  # -> ExecResult
    async with sandbox.RedisSandbox("redis://HOST:6379/0") as sb:   # `python -m sandbox worker`s elsewhere
        ...
    async with sandbox.HTTPSandbox("http://HOST:8088") as sb:        # `python -m sandbox serve` elsewhere
        ...
"""

import importlib

from sandbox import moved_modules  # noqa: F401 - old module paths fail with the new one named

# Every name loads its module on first use: `import sandbox` costs nothing (rstar2_jax imports it
# for moved_modules), and the remote clients' libraries (redis, aiohttp) load only for their users.
_EXPORTS = {
    "SandboxClient": "sandbox.client", "SandboxSession": "sandbox.client",
    "ISOLATION_MODES": "sandbox.local", "LocalSandbox": "sandbox.local", "Session": "sandbox.local",
    "SessionLimitError": "sandbox.local", "SandboxStartError": "sandbox.pool",
    "STATUSES": "sandbox.result", "ExecResult": "sandbox.result", "Limits": "sandbox.result",
    "RedisSandbox": "sandbox.redis_queue.client", "HTTPSandbox": "sandbox.http_service.client",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
