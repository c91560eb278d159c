"""Dispatch turn requests across several engines (vLLM servers and/or JaxEngines).

    engine = Scheduler([VLLMEngine(url1, model), VLLMEngine(url2, model)], policy="kv_aware")
    traj = await run_agent(engine, sandbox, ...)   # a Scheduler is itself an Engine

The unit of scheduling is one turn (one `generate` call): when a turn ends in a tool call, the
agent loop sends the call to the sandbox at once and the trajectory comes back to the scheduler
with its next turn when the result arrives, so no engine waits on a tool.

Policies (pure functions of the engines' loads; the simulation benchmark runs the same ones):
- "kv_aware" (rStar2-Agent's load balancer): a request reserves prompt + new tokens of KV; it
  goes to the engine with the most free KV tokens that can hold it, and waits (FIFO) when none
  can, instead of pushing an engine into preemption. Free = capacity - max(our reservations,
  what the engine reports in use), refreshed from each engine's metrics, so usage by other
  clients counts too.
- "round_robin", "least_requests": the usual baselines.

Prefix affinity (`affinity=True`, the default): a trajectory's turns share a growing prefix, and
only the engine that ran its previous turn holds that prefix in its KV/prefix cache. A turn that
names its trajectory (`session`) goes back to that engine ("home") whenever it is healthy and has
room for it; otherwise it spills to where the policy puts it, which becomes its new home
(`pick_with_affinity`). Without affinity, a kv_aware scheduler sends successive turns to whichever
engine is emptiest, and each move re-prefills the whole trajectory. `prefix_cache_hit_rate()`
reports what the servers saw (vLLM's prefix-cache counters).

A request whose engine fails (EngineUnavailable: a server down past its restart window) is sent to another
engine; the failed engine is skipped until it answers again.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import Hashable, Sequence

from rstar2_jax.rollout.engines.accounting import merge_work
from rstar2_jax.rollout.engines.base import Completion, Engine, EngineUnavailable, ServerLoad, SyncTarget
from rstar2_jax.rollout.engines.scheduler_policies import POLICIES, EngineLoad, pick_with_affinity, reservation
from rstar2_jax.rollout.engines.sampling import SamplingParams

log = logging.getLogger(__name__)


class Scheduler(Engine):
    def __init__(self, engines: Sequence, policy: str = "kv_aware", *, reserve_new_tokens: int | None = None,
                 refresh_s: float = 1.0, affinity: bool = True, max_sessions: int = 1 << 16):
        if not engines:
            raise ValueError("Scheduler needs at least one engine")
        POLICIES[policy]  # an unknown name: UnknownNameError with the registered ones
        self.engines = list(engines)
        self.policy = policy
        self.reserve_new_tokens = reserve_new_tokens
        self.refresh_s = refresh_s
        initial = [e.load() for e in self.engines]  # one metrics read per server at start-up
        self.loads = [EngineLoad(capacity_tokens=l.kv_capacity_tokens) for l in initial]
        self.dispatched = [0] * len(self.engines)   # turns sent to each engine
        self.rerouted = 0                            # turns sent again after their engine failed
        self.affinity = affinity
        self.stayed = 0                              # turns placed on their session's home engine
        self.spilled = 0                             # turns whose home had no room (or was down)
        self._homes: collections.OrderedDict = collections.OrderedDict()  # session -> engine, LRU
        self._max_sessions = max_sessions
        self._cache_baseline = [(l.prefix_cache_queries, l.prefix_cache_hits) for l in initial]
        self._turns = itertools.count()
        self._changed: asyncio.Condition | None = None
        self._last_refresh = 0.0
        self._sync_units: list[SyncTarget] | None = None

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    @property
    def weights_on_servers(self) -> bool:
        return all(e.weights_on_servers for e in self.engines)

    def update_weights(self, params, version: int | None = None) -> None:
        """This process alone: each sync unit in turn."""
        version = self.version + 1 if version is None else version
        for unit in self._units():
            unit.update_weights(params, version)

    async def sync_weights(self, params, version: int) -> None:
        """Each sync unit in turn, as it syncs itself (an engine, or engines of one class that take
        one sync together: Engine.sync_units); the same order in every trainer process."""
        self.given_version = version
        for unit in self._units():
            await unit.sync_weights(params, version)

    @property
    def failed_syncs(self) -> int:
        return sum(unit.failed_syncs for unit in self._units())

    async def weights_at_least(self, version: int) -> None:
        for e in self.engines:
            await e.weights_at_least(version)

    def sync_paused_s(self) -> float | None:
        paused = [p for p in (e.sync_paused_s() for e in self.engines) if p is not None]
        return max(paused) if paused else None

    def _units(self) -> list[SyncTarget]:
        """The engines as sync units, each class grouping its own (Engine.sync_units)."""
        if self._sync_units is None:
            classes = list(dict.fromkeys(type(e) for e in self.engines))
            self._sync_units = [u for cls in classes for u in cls.sync_units([e for e in self.engines
                                                                                if type(e) is cls])]
        return self._sync_units

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = (), *, session: Hashable | None = None) -> Completion:
        need = reservation(len(prompt_ids), sampling.max_tokens, self.reserve_new_tokens)
        changed = self._condition()
        while True:
            index = await self._acquire(need, session)
            try:
                return await self.engines[index].generate(prompt_ids, sampling, stop, session=session)
            except EngineUnavailable as e:
                log.warning("engine %d failed (%s); sending the turn elsewhere", index, e)
                self.loads[index].healthy = False
                self.rerouted += 1
                if not any(l.healthy for l in self.loads):
                    raise
            finally:
                async with changed:
                    self.loads[index].reserved_tokens -= need
                    self.loads[index].in_flight -= 1
                    changed.notify_all()

    async def _acquire(self, need: int, session: Hashable | None = None) -> int:
        """Wait until the policy places the request (at its session's home when that fits); reserve there."""
        changed = self._condition()
        home = self._homes.get(session) if self.affinity and session is not None else None
        while True:
            await self._refresh()
            async with changed:
                index = pick_with_affinity(POLICIES[self.policy], self.loads, need, next(self._turns), home)
                if index is not None:
                    load = self.loads[index]
                    load.reserved_tokens += need
                    load.in_flight += 1
                    self.dispatched[index] += 1
                    if home is not None:
                        self.stayed += index == home
                        self.spilled += index != home
                    if session is not None:
                        self._remember(session, index)
                    return index
                try:  # woken by a finished request, or re-read the metrics after refresh_s
                    await asyncio.wait_for(changed.wait(), max(self.refresh_s, 0.05))
                except asyncio.TimeoutError:
                    pass

    def _remember(self, session: Hashable, index: int):
        self._homes[session] = index
        self._homes.move_to_end(session)
        while len(self._homes) > self._max_sessions:
            self._homes.popitem(last=False)

    def prefix_cache_hit_rate(self) -> float | None:
        """Share of prompt tokens the servers found in their prefix caches since this scheduler
        started (None when they report no lookups, e.g. JaxEngines)."""
        queries = hits = 0
        for engine, (q0, h0) in zip(self.engines, self._cache_baseline):
            load = engine.load()
            queries += load.prefix_cache_queries - q0
            hits += load.prefix_cache_hits - h0
        return hits / queries if queries > 0 else None

    async def _refresh(self):
        """Re-read the engines' metrics at most every refresh_s (and retry unhealthy ones)."""
        now = time.monotonic()
        if now - self._last_refresh < self.refresh_s:
            return
        self._last_refresh = now
        for i, e in enumerate(self.engines):
            try:
                load: ServerLoad = await asyncio.to_thread(e.load)
            except EngineUnavailable:
                self.loads[i].healthy = False
                continue
            self.loads[i].capacity_tokens = load.kv_capacity_tokens
            self.loads[i].used_tokens = load.kv_capacity_tokens - load.free_kv_tokens
            self.loads[i].healthy = True

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def load(self) -> ServerLoad:
        """The engines' loads added up (usage weighted by capacity)."""
        loads = [e.load() for e in self.engines]
        capacity = sum(l.kv_capacity_tokens for l in loads)
        used = sum(l.kv_capacity_tokens * l.kv_usage for l in loads)
        return ServerLoad(kv_usage=used / capacity if capacity else 0.0, kv_capacity_tokens=capacity,
                          running=sum(l.running for l in loads), waiting=sum(l.waiting for l in loads),
                          preemptions=sum(l.preemptions for l in loads))

    def take_owned(self, owner):
        return merge_work(e.take_owned(owner) for e in self.engines)

    async def close(self):
        for e in self.engines:
            await e.close()

