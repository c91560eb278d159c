"""Decode in chunks: several tokens per dispatch, and the host out of the device's way.

With `decode_steps=K > 1` the JaxEngine decodes in chunks: one jitted call (jax_engine/kernels.py,
`decode_chunk`) runs up to K decode steps in a device loop. Each step samples every live slot's
next token with the slot's own key, appends it, and ends the slot inside the graph on EOS, a
single-token stop (a tool-call boundary such as `</tool_call>`), its token budget or its KV room.
The slots' state between chunks (DecodeCarry: last token, position, sample index, budget, live)
stays on the device, so the next chunk is dispatched from the last one's carry *before* the host
reads the last one's tokens: the device runs chunk n+1 while the host appends chunk n's tokens,
matches stop strings, retires finished requests and admits new ones.

The host is one chunk behind the device, so whatever it changes about a slot (a request admitted,
preempted, or finished by a multi-token stop string, which only the host can match: the device
keeps decoding it for at most this and the next chunk, and those tokens are dropped) marks the slot
dirty, and the next chunk takes that slot's state from the host instead of the carry. A chunk's
tokens for a slot are applied only if the slot still holds the request it held at dispatch.

The same tokens as one step per dispatch: a token is sampled with the key of (the request's seed,
its index) and its KV written at its position, whichever chunk it falls in; tokens sampled past a
host-matched stop, or for a request preempted meanwhile (which samples them again after its
recompute, with the same keys), are dropped. Log-probs are equal too, except under paged-KV
preemption, where they differ by float32 rounding (up to 1e-6, issue 80; the tests compare at
1e-5 there): the tokens are the same. Where in the recompute the rounding enters was not traced.
Paged KV gives each row the pages of the positions the chunks in flight may write before they
are dispatched (`lookahead`).

A chunk ends early once no slot is live, checked every `exit_check_steps` steps (1 by default:
every step). On a GPU each check is a device-to-host copy and a wait before the next step is
queued (XLA runs a loop of unknown trip count so); checking every K steps queues the chunk whole,
at the price of up to K - 1 idle steps when every slot ends in the same chunk. The tokens are the
same either way.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from rstar2_jax.rollout.engines.jax_engine.kernels import DecodeCarry
from rstar2_jax.rollout.engines.jax_engine.slot_requests import DecodeHost, Request


# Tokens per dispatch unless told otherwise: on the tiny CPU model (BENCHMARKS.md, "JaxEngine on
# the CPU") 16 gives 3.3x the tokens/s of one step at 1 slot and 1.45x at 16; 64 adds little, and a
# slot that ends mid-chunk idles until the chunk ends, so longer chunks cost agentic turns more.
DEFAULT_DECODE_STEPS = 16
MIN_STOP_COLUMNS = 4  # stop-id table width, rounded up to a power of two (a few compiled shapes)


@dataclasses.dataclass
class _Chunk:
    """A dispatched chunk: its outputs (device arrays, not yet read) and what it was given."""
    outputs: tuple[Any, ...]         # tokens, log-probs, real [K, S]; steps run
    owners: list[Request | None]    # the request each slot served at dispatch
    version: int                     # the weights it sampled with
    dispatched: float


class ChunkedDecode:
    """The engine's chunk loop: what the device carries between chunks, the slots the host changed
    since, and the one chunk in flight."""

    def __init__(self, slots: int, steps: int, check_every: int = 1):
        if check_every < 1 or steps % check_every:
            raise ValueError(f"exit_check_steps={check_every} must be >= 1 and divide decode_steps={steps} (the "
                             "chunk checks for a live slot between blocks of that many steps)")
        self.steps = steps
        self.check_every = check_every  # steps between the loop's checks for a live slot (jax_engine/kernels.py)
        self.carry: DecodeCarry | None = None
        self.dirty: set[int] = set(range(slots))
        self.in_flight: _Chunk | None = None
        self.last_read = 0.0  # when the last chunk's tokens were read (monotonic)

    @property
    def lookahead(self) -> int:
        """Decode steps the device may run for a slot before the host next sees it: the chunk in
        flight and the one about to be dispatched (paged KV allocates their pages first)."""
        return self.steps * (2 if self.in_flight is not None else 1)

    def changed(self, slot: int) -> None:
        self.dirty.add(slot)

    async def step(self, engine: DecodeHost, loop) -> None:
        """Dispatch the next chunk, then read and apply the one before it."""
        previous, self.in_flight = self.in_flight, None
        if any(engine.active):
            args, owners, version = self._inputs(engine)

            def dispatch():  # returns once the chunk is queued: nothing here waits for the device
                start = time.monotonic()
                cache, carry, *outputs = engine.kernels.decode_chunk(*args, steps=self.steps, check_every=self.check_every)
                return cache, carry, outputs, start

            engine.cache, self.carry, outputs, start = await loop.run_in_executor(engine.executor, dispatch)
            self.dirty.clear()
            self.in_flight = _Chunk(tuple(outputs), owners, version, start)
        if previous is not None:
            await self._apply(engine, loop, previous)

    def precompile(self, engine: DecodeHost) -> None:
        """Compile the chunk before serving (every slot idle: the loop runs no step),
        entered as the run enters it: first from the host's state, then from a device carry (jit's
        dispatch cache keys NumPy and device arguments apart; nothing compiles twice)."""
        args, _, _ = self._inputs(engine)  # no carry yet: the host's state for every slot
        shape = dict(steps=self.steps, check_every=self.check_every)
        engine.cache, carry, *_ = engine.kernels.decode_chunk(*args, **shape)
        state, _, table, _, *rest = args
        engine.cache, *_ = engine.kernels.decode_chunk(state, engine.cache, table, carry, *rest, **shape)

    async def drain(self, engine: DecodeHost, loop) -> None:
        """Read and apply the chunk in flight (the engine has nothing else to dispatch)."""
        if self.in_flight is not None:
            chunk, self.in_flight = self.in_flight, None
            await self._apply(engine, loop, chunk)

    def _inputs(self, engine: DecodeHost):
        """The chunk's arguments: the host's view of every dirty slot (all of them before the first
        chunk), the carry for the rest, and each slot's sampling constants and stop ids."""
        slots, idle = engine.slots, engine.max_len
        tokens = np.zeros(slots, np.int32)
        positions = np.full(slots, idle, np.int32)
        counters = np.zeros(slots, np.int32)
        remaining = np.zeros(slots, np.int32)
        active = np.zeros(slots, bool)
        seeds = np.zeros(slots, np.uint32)
        temperature = np.ones(slots, np.float32)
        top_k = np.zeros(slots, np.int32)
        top_p = np.ones(slots, np.float32)
        stops = [engine.device_stop_ids(r) if r is not None else () for r in engine.active]
        width = max(MIN_STOP_COLUMNS, 1 << (max(map(len, stops), default=1) - 1).bit_length())
        stop_ids = np.full((slots, width), -1, np.int32)
        for slot, req in enumerate(engine.active):
            stop_ids[slot, :len(stops[slot])] = stops[slot]
            if req is None:
                continue
            seeds[slot], temperature[slot] = req.seed, req.sampling.temperature
            top_k[slot], top_p[slot] = req.sampling.top_k, req.sampling.top_p
            tokens[slot], positions[slot] = req.generated[-1], len(req.context()) - 1
            counters[slot], remaining[slot], active[slot] = len(req.generated), engine.remaining(req), True
        fresh = DecodeCarry(tokens, positions, counters, remaining, active)
        take_fresh = np.ones(slots, bool) if self.carry is None else np.isin(np.arange(slots), list(self.dirty))
        table = engine.kv.decode_table([i if r is not None else None for i, r in enumerate(engine.active)])
        args = (engine.state, engine.cache, table, self.carry if self.carry is not None else fresh, fresh,
                take_fresh, seeds, temperature, top_k, top_p, stop_ids, np.int32(idle))
        return args, list(engine.active), engine.version

    async def _apply(self, engine: DecodeHost, loop, chunk: _Chunk) -> None:
        def read():
            tokens, logps, real, steps = (np.asarray(x) for x in chunk.outputs)
            return tokens, logps, real, int(steps), time.monotonic()

        tokens, logps, real, steps, end = await loop.run_in_executor(engine.executor, read)
        # the device ran this chunk after the one before it: its time starts where that one's read
        # ended (chunks overlap from dispatch to read; counted from dispatch, decode_s would double)
        start = max(chunk.dispatched, self.last_read)
        self.last_read = end
        engine.stats.decode_s += end - start
        engine.stats.decode_steps += steps
        engine.stats.busy_slot_steps += int(real.sum())
        served = [req.owner for slot, req in enumerate(chunk.owners) if req is not None
                  for _ in range(int(real[:, slot].sum()))]
        engine.ledger.charge_decode(served, start, end, int(real.sum()), steps=steps)
        for slot, req in enumerate(chunk.owners):
            for i in range(steps):
                if req is None or engine.active[slot] is not req or not real[i, slot]:
                    break  # finished, preempted or replaced since dispatch: the rest is not its
                engine.append(slot, int(tokens[i, slot]), float(logps[i, slot]), chunk.version)
