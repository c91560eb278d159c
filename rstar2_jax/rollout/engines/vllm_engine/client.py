"""HTTP to one vLLM server: JSON calls with failures sorted into retryable (ServerUnavailable)
and not (ServerRequestError), and its Prometheus /metrics read as a ServerLoad.

Two clients with the same errors: `AsyncVLLMClient` (aiohttp) for the generation path, where
hundreds of requests are in flight at once, and the blocking `VLLMClient` (urllib) for the
control plane the Engine interface calls synchronously (weight reloads, probes, /metrics).
Both carry the job's secret ($RSTAR2_SECRET) where one is set: the servers then refuse anyone
without it (vllm_engine/server.py).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from rstar2_jax.rollout.engines.base import EngineUnavailable, ServerLoad
from rstar2_jax.rollout.engines.vllm_engine.server import is_ready
from sandbox.job_secret import bearer_headers, job_secret


class ServerUnavailable(EngineUnavailable):
    """The server did not answer (refused, reset, timed out, or a 5xx)."""


class ServerRequestError(ValueError):
    """The server rejected the request (4xx): retrying it would not help."""


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for each sample of Prometheus text exposition (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value)) for family in text_string_to_metric_families(text)
            for s in family.samples]


def server_load(metrics_text: str) -> ServerLoad:
    sums: dict[str, float] = {}
    capacity = engines = 0
    for name, labels, value in parse_prometheus(metrics_text):
        if name == "vllm:cache_config_info":
            capacity += int(float(labels.get("kv_cache_size_tokens") or 0))
        elif name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                      "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            sums[name] = sums.get(name, 0.0) + value
            engines += name == "vllm:kv_cache_usage_perc"  # one sample per engine core
    return ServerLoad(kv_usage=sums.get("vllm:kv_cache_usage_perc", 0.0) / max(1, engines), kv_capacity_tokens=capacity,
                      running=int(sums.get("vllm:num_requests_running", 0)),
                      waiting=int(sums.get("vllm:num_requests_waiting", 0)),
                      preemptions=int(sums.get("vllm:num_preemptions_total", 0)),
                      prefix_cache_queries=int(sums.get("vllm:prefix_cache_queries_total", 0)),
                      prefix_cache_hits=int(sums.get("vllm:prefix_cache_hits_total", 0)))


class VLLMClient:
    """Blocking JSON-over-HTTP calls to one server (run them in threads from async code)."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = bearer_headers(job_secret())

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={**self.headers, **({"Content-Type": "application/json"} if data else {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code >= 500:
                raise ServerUnavailable(f"{method} {self.url}{path}: HTTP {e.code}: {detail}") from e
            raise ServerRequestError(f"{method} {self.url}{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError, OSError) as e:
            raise ServerUnavailable(f"{method} {self.url}{path}: {e}") from e
        text = raw.decode()
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    def get_text(self, path: str, timeout: float = 10.0) -> str:
        out = self.request("GET", path, timeout=timeout)
        return out if isinstance(out, str) else json.dumps(out)

    def alive(self) -> bool:
        return is_ready(self.url)


class AsyncVLLMClient:
    """The same JSON calls over aiohttp, for coroutines: one connection pool per event loop."""

    def __init__(self, url: str, timeout: float = 600.0, max_connections: int = 256):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_connections = max_connections
        self.headers = bearer_headers(job_secret())
        self._session = None
        self._loop = None

    def _session_for_this_loop(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections),
                                                  headers=self.headers)
            self._loop = loop
        return self._session

    async def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        import aiohttp

        session = self._session_for_this_loop()
        try:
            async with session.request(method, self.url + path, json=body,
                                       timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)) as r:
                text = await r.text(errors="replace")
                if r.status >= 500:
                    raise ServerUnavailable(f"{method} {self.url}{path}: HTTP {r.status}: {text[:2000]}")
                if r.status >= 400:
                    raise ServerRequestError(f"{method} {self.url}{path}: HTTP {r.status}: {text[:2000]}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError) as e:
            raise ServerUnavailable(f"{method} {self.url}{path}: {e!r}") from e
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    async def close(self):
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
