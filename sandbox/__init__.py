"""Secure, fast Python execution for tool calls. Usable on its own; imports nothing of rstar2_jax.

    import sandbox
    async with sandbox.LocalSandbox(workers=4) as sb:
        res = await sb.run("print(1 + 1)", stdin="", timeout=5.0)  # -> ExecResult
"""

from sandbox.local import ISOLATION_MODES, LocalSandbox, Session
from sandbox.pool import SandboxStartError
from sandbox.result import STATUSES, ExecResult, Limits

__all__ = ["ExecResult", "ISOLATION_MODES", "Limits", "LocalSandbox", "STATUSES", "SandboxStartError", "Session"]
