"""Who an engine's work was for: per-owner counters, so overlapping RL steps each see their own.

With asynchronous rollouts the engine serves several steps at once; an engine-wide delta read
at the end of a step counts the other steps' requests too. Instead, each request carries its
owner (the step whose rollout it is), taken from a context variable when it is submitted:

    with owned_by(("rollout", step)):       # asyncio tasks created under it inherit the owner
        await rollout_problems(engine, ...)
    work = engine.take_owned(("rollout", step))   # that step's counters and busy intervals only

and the engine charges each piece of work to the owners of the requests it served: a prefill to
its request's owner; a decode step to every owner with a request in the batch (its busy time, the
slots busy in it, and the slots that owner's requests held); a preemption to the preempted
request's owner. Requests submitted with no owner are charged to `None` (evaluation, top-ups).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections import defaultdict
from typing import Hashable, Iterable

from rstar2_jax.rollout.engines.base import EngineStats

_owner: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar("rstar2_request_owner", default=None)


@contextlib.contextmanager
def owned_by(owner: Hashable):
    """Requests submitted under this block (asyncio tasks created in it too) belong to `owner`."""
    token = _owner.set(owner)
    try:
        yield owner
    finally:
        _owner.reset(token)


def current_owner() -> Hashable | None:
    return _owner.get()


@dataclasses.dataclass
class OwnedWork:
    """One owner's share of an engine's work."""
    stats: EngineStats                                  # its counters (slots: the engine's slots)
    busy: list[tuple[float, float]]                     # device (or request) intervals that served it
    prefix_cache_queries: int = 0                       # prompt tokens its requests looked up (servers that report it)
    prefix_cache_hits: int = 0

    def merged(self, other: OwnedWork) -> OwnedWork:
        """Two engines' shares (a scheduler over several) as one."""
        a, b = self.stats, other.stats
        stats = EngineStats(*(getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(EngineStats)))
        return OwnedWork(stats, self.busy + other.busy, self.prefix_cache_queries + other.prefix_cache_queries,
                         self.prefix_cache_hits + other.prefix_cache_hits)


def merge_work(shares) -> OwnedWork | None:
    """Several shares of work (engines behind a scheduler, or one owner's steps) as one; None
    entries (engines that do not account) are skipped, and None when nothing is left."""
    shares = [w for w in shares if w is not None]
    return functools.reduce(OwnedWork.merged, shares) if shares else None


class OwnerLedger:
    """Per-owner counters of one engine; the engine charges, the trainer takes (and forgets)."""

    def __init__(self, slots: int = 1):
        self.slots = slots
        self._work: dict[Hashable, OwnedWork] = defaultdict(self._empty)

    def _empty(self) -> OwnedWork:
        return OwnedWork(EngineStats(slots=self.slots), [])

    def charge_prefill(self, owner, start: float, end: float, tokens: int, reused: int):
        w = self._work[owner]
        w.stats.prefill_s += end - start
        w.stats.prefill_tokens += tokens
        w.stats.reused_tokens += reused
        w.busy.append((start, end))

    def charge_decode(self, owners: Iterable, start: float, end: float, busy_slots: int, steps: int = 1):
        """`steps` decode steps (one, or a chunk's) that served the requests whose owners are
        `owners` (one entry per request and step: an owner with two requests in the batch appears
        twice a step); `busy_slots`: the slot-steps of all of them."""
        held: dict = defaultdict(int)
        for o in owners:
            held[o] += 1
        for o, n in held.items():
            w = self._work[o]
            w.stats.decode_s += end - start
            w.stats.decode_steps += steps
            w.stats.busy_slot_steps += busy_slots
            w.stats.own_slot_steps += n
            w.busy.append((start, end))

    def charge_preemption(self, owner):
        self._work[owner].stats.preemptions += 1

    def charge_request(self, owner, start: float, end: float, prompt_tokens: int = 0, cached_tokens: int | None = None):
        """A whole request answered by a server (vLLM): its wall interval, and its prompt tokens
        looked up in the prefix cache and found there when the server reports them."""
        w = self._work[owner]
        w.busy.append((start, end))
        if cached_tokens is not None:
            w.prefix_cache_queries += prompt_tokens
            w.prefix_cache_hits += cached_tokens

    def take(self, owner) -> OwnedWork:
        """`owner`'s work so far, forgotten here (an owner not seen: empty)."""
        return self._work.pop(owner, None) or self._empty()
