"""A vLLM server middleware: every request must carry the job's secret.

Loaded by vLLM itself (`--middleware rstar2_vllm_auth.RequireSecret`, this directory on the
server's PYTHONPATH; vllm_engine/server.server_command adds both where $RSTAR2_SECRET is set), so it
runs in the vLLM venv and imports nothing but the standard library.

vLLM's own `--api-key` is not enough for RL: in vLLM 0.32 it guards only the routes under /v1,
/v2, /inference and /cohere (GUARDED_PREFIX in vllm/entrypoints/serve/middleware/authenticate.py),
and leaves open the routes VLLM_SERVER_DEV_MODE adds for the weight sync (/collective_rpc,
/pause, /resume, /reset_prefix_cache, /update_weight_version): with those, anyone who reaches the
server could make it reload weights of their choosing. This guards every HTTP route and
websocket, /health and /metrics included.
"""

from __future__ import annotations

import hmac
import os

SECRET_ENV = "RSTAR2_SECRET"  # sandbox/job_secret.py's name (not imported: that package is not in this venv)
REFUSAL = b'{"error": "missing or wrong secret (Authorization: Bearer $RSTAR2_SECRET)"}'


class RequireSecret:
    """Pure ASGI middleware: a request without `Authorization: Bearer $RSTAR2_SECRET` gets a 401
    (a websocket is closed before it opens) and never reaches vLLM."""

    def __init__(self, app):
        secret = os.environ.get(SECRET_ENV)
        if not secret:
            raise RuntimeError(f"rstar2_vllm_auth: ${SECRET_ENV} is not set in the server's environment")
        self.app = app
        self.expected = f"Bearer {secret}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan: the server's own start and stop
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(REFUSAL)).encode())]})
        await send({"type": "http.response.body", "body": REFUSAL})
