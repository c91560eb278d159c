"""The HTTP service's Prometheus metrics (prometheus_client), served at /metrics."""

from __future__ import annotations

from sandbox.result import ExecResult

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """The service's Prometheus metrics, kept by prometheus_client (one registry per server, so
    several servers in one process do not share counters); /metrics is its text exposition.
    Counters are bumped with `count(name)`; reads (`metrics.cancelled`, ...) give their values."""

    COUNTERS = {
        "bad_requests": "Requests rejected with a 4xx.",
        "cancelled": "Calls cancelled because their client went away.",
        "refused_connections": "Connections refused past the limit.",
        "evicted_connections": "Unauthenticated connections closed to admit others.",
        "write_timeouts": "Connections closed because the client stopped reading.",
    }

    def __init__(self):
        import prometheus_client as prom
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self._queue_depth = prom.Gauge("sandbox_queue_depth", "Calls waiting for a worker.", registry=r)
        self._in_flight = prom.Gauge("sandbox_in_flight", "Calls accepted and not yet answered.", registry=r)
        self._results = prom.Counter("sandbox_results", "Results by status.", ["status"], registry=r)
        self._counters = {name: prom.Counter(f"sandbox_{name}", doc, registry=r) for name, doc in self.COUNTERS.items()}
        self._latency = prom.Histogram("sandbox_latency_seconds", "Time from request to result.",
                                       buckets=LATENCY_BUCKETS, registry=r)

    def count(self, name: str):
        self._counters[name].inc()

    def __getattr__(self, name: str) -> int:  # metrics.cancelled, metrics.write_timeouts, ...
        if name in Metrics.COUNTERS:
            return int(self.registry.get_sample_value(f"sandbox_{name}_total") or 0)
        raise AttributeError(name)

    @property
    def in_flight(self) -> int:
        return int(self.registry.get_sample_value("sandbox_in_flight") or 0)

    def call_started(self):
        self._in_flight.inc()

    def call_ended(self):
        self._in_flight.dec()

    def observe(self, result: ExecResult, seconds: float):
        self._results.labels(status=result.status).inc()
        self._latency.observe(seconds)

    def render(self, queue_depth: int) -> str:
        import prometheus_client as prom
        self._queue_depth.set(queue_depth)
        return prom.generate_latest(self.registry).decode()
