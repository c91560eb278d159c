"""Where an RL step's wall time goes: intervals of named activities, and their overlap.

Many trajectories run at once, so summed durations say little ("400 s of tool calls in a 30 s
rollout"). What matters is wall time: how long *some* tool call was in flight, and how much of
that the engine sat idle (the pipeline waited on tools) versus kept generating (the tool call
was hidden). The interval arithmetic is pure; `Timeline` just collects (start, end) pairs.

    timeline = Timeline()
    with timeline.activate():           # code under it (asyncio tasks too) records into it
        ...  with span("tool"): await sandbox.run(...)
    timeline.union("tool"), exclusive_length(timeline.get("tool"), engine_busy)
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections import defaultdict
from typing import Iterable, Sequence

Interval = tuple[float, float]

_current: contextvars.ContextVar["Timeline | None"] = contextvars.ContextVar("rstar2_timeline", default=None)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_length(intervals: Iterable[Interval]) -> float:
    """Wall time covered by at least one interval."""
    return sum(b - a for a, b in merge(intervals))


def overlap_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Wall time covered by both some interval of `a` and some interval of `b`."""
    ma, mb = merge(a), merge(b)
    i = j = 0
    total = 0.0
    while i < len(ma) and j < len(mb):
        lo, hi = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        total += max(0.0, hi - lo)
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total


def exclusive_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Wall time covered by `a` but by nothing in `b` (tool calls with the engine idle)."""
    a = list(a)
    return union_length(a) - overlap_length(a, b)


class Timeline:
    def __init__(self):
        self._spans: dict[str, list[Interval]] = defaultdict(list)

    def add(self, kind: str, start: float, end: float) -> None:
        self._spans[kind].append((start, end))

    def extend(self, kind: str, intervals: Sequence[Interval]) -> None:
        self._spans[kind].extend(intervals)

    def get(self, kind: str) -> list[Interval]:
        return list(self._spans.get(kind, ()))

    def union(self, kind: str) -> float:
        return union_length(self._spans.get(kind, ()))

    @contextlib.contextmanager
    def span(self, kind: str):
        """Record the enclosed wall time as `kind`."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(kind, start, time.monotonic())

    @contextlib.contextmanager
    def activate(self):
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


def span(kind: str):
    """Record the enclosed wall time as `kind` in the active Timeline (none active: no-op)."""
    timeline = _current.get()
    return timeline.span(kind) if timeline is not None else contextlib.nullcontext()
