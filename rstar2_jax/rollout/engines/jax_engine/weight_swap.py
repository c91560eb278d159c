"""The JaxEngine's weights, and when a new version takes over from the one decoding.

`LiveWeights` holds the version that samples and, while it lands, the next one. Two choices, each a
typed policy picked once from the config (rollout.jax.swap, rollout.jax.inflight_kv), never
compared as a string:

- `SwapTiming`: when weights given mid-request take over. NEXT_CHUNK: at once (the next dispatch
  waits on the device for their copy: the same step every run). LANDED: at the first chunk boundary
  after every array of the copy is ready, or at once when nothing decodes (decoding never waits for
  a copy; the old weights stay alive until then, a second buffer the memory plan counts).
- `InflightKV`: what requests in flight keep when a version takes over. KEEP: their KV, computed by
  the old weights (PipelineRL's in-flight update). RECOMPUTE: nothing; each is admitted again and
  its context prefilled by the new weights, as after a preemption (the engine does it at its loop's
  top: `needs_recompute`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

import jax

from rstar2_jax.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class SwapTiming:
    name: str
    waits_for_landing: bool  # False: a version takes over as soon as it is given

    def takes_over(self, state, decoding: bool) -> bool:
        """Whether weights `state` (given, not yet taken over) take over now."""
        return not self.waits_for_landing or not decoding or landed(state)


@dataclasses.dataclass(frozen=True)
class InflightKV:
    name: str
    recomputes: bool


NEXT_CHUNK = SwapTiming("next_chunk", waits_for_landing=False)
LANDED = SwapTiming("landed", waits_for_landing=True)
KEEP, RECOMPUTE = InflightKV("keep", recomputes=False), InflightKV("recompute", recomputes=True)
# rollout.jax.swap and rollout.jax.inflight_kv: their settings take these as their choices
SWAP_TIMINGS: Registry[SwapTiming] = Registry("weight swap timing")
INFLIGHT_KVS: Registry[InflightKV] = Registry("in-flight KV policy")
for _entry in (NEXT_CHUNK, LANDED):
    SWAP_TIMINGS.register(_entry.name, _entry)
for _entry in (KEEP, RECOMPUTE):
    INFLIGHT_KVS.register(_entry.name, _entry)


def landed(state) -> bool:
    """Whether every array of a weight copy is on its device (the copy done)."""
    return all(x.is_ready() for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


class LiveWeights:
    """The weights that sample (`state`, `version`) and the next version while it lands."""

    def __init__(self, state, timing: SwapTiming, inflight_kv: InflightKV):
        self.state, self.version = state, 0
        self.timing, self.inflight_kv = timing, inflight_kv
        self.pending: tuple[Any, int] | None = None  # given, not yet taken over, and its version
        self.needs_recompute = False  # RECOMPUTE: a version took over while requests were in flight
        self._swapped: asyncio.Event | None = None  # set whenever a version takes over

    def give(self, state, version: int, decoding: bool, in_flight: bool) -> None:
        """New weights as `version` (placed on the engine's devices, maybe still copying): they
        take over now, unless their timing waits for the copy and requests are decoding."""
        self.pending = (state, version)
        if not (self.timing.waits_for_landing and decoding):
            self._take_pending(in_flight)

    def at_boundary(self, decoding: bool, in_flight: bool) -> None:
        """Between dispatches: the weights given take over if their timing says so."""
        if self.pending is not None and self.timing.takes_over(self.pending[0], decoding):
            self._take_pending(in_flight)

    def _take_pending(self, in_flight: bool) -> None:
        (state, version), self.pending = self.pending, None
        self.needs_recompute |= self.inflight_kv.recomputes and version != self.version and in_flight
        self.state, self.version = state, version
        if self._swapped is not None:
            self._swapped.set()

    async def at_least(self, version: int, wake: Callable[[], None]) -> None:
        """Until weights of `version` or newer have taken over; `wake` rouses an idle engine loop,
        which takes them over at its next boundary (nothing decoding: at once)."""
        while self.version < version:
            if self.pending is None:  # nothing on its way: its weights are the latest
                return
            self._swapped = self._swapped or asyncio.Event()
            self._swapped.clear()
            wake()
            await self._swapped.wait()
