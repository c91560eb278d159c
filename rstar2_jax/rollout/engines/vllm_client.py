"""HTTP to one vLLM server: JSON calls with failures sorted into retryable (ServerUnavailable)
and not (ServerRequestError), and its Prometheus /metrics read as a ServerLoad.

Blocking (urllib): async callers run these in threads.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.error
import urllib.request
from typing import Any

from rstar2_jax.rollout.engines.base import ServerLoad
from rstar2_jax.rollout.engines.vllm_server import is_ready


class ServerUnavailable(ConnectionError):
    """The server did not answer (refused, reset, timed out, or a 5xx)."""


class ServerRequestError(ValueError):
    """The server rejected the request (4xx): retrying it would not help."""


_METRIC_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for each sample line of Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if m:
            out.append((m["name"], dict(_LABEL.findall(m["labels"] or "")), float(m["value"])))
    return out


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

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
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
