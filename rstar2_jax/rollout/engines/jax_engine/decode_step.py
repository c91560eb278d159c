"""Decode one token per dispatch (rollout.jax.decode_steps=1): the host builds every slot's
inputs, dispatches one decode step, reads its tokens and appends them before the next. The
reference the chunked decode (jax_engine/decode_chunks.py) is held to, token for token; both give the
JaxEngine the same small interface (step, drain, precompile, lookahead, in_flight, changed)."""

from __future__ import annotations

import time

import numpy as np

from rstar2_jax.rollout.engines.jax_engine.slot_requests import DecodeHost


class StepDecode:
    """One decode step a dispatch, read before the next: nothing in flight between steps."""

    lookahead = 1  # decode steps the device may run for a slot before the host sees it
    in_flight = None

    def changed(self, slot: int) -> None:
        """Nothing is carried between steps: every step reads the host's state."""

    async def drain(self, engine: DecodeHost, loop) -> None:
        """Nothing is ever in flight."""

    def precompile(self, engine: DecodeHost) -> None:
        inputs, _ = decode_inputs(engine)  # every slot idle: every write dropped
        engine.cache, _, _ = engine.kernels.decode(engine.state, engine.cache, *inputs)

    async def step(self, engine: DecodeHost, loop) -> None:
        inputs, busy = decode_inputs(engine)
        args = (engine.state, engine.cache) + inputs
        version = engine.version  # the weights in `args`, whatever a sync does while they run
        owners = [r.owner for r in engine.active if r is not None]  # the requests this step serves

        def run():
            start = time.monotonic()
            cache, token, logp = engine.kernels.decode(*args)
            token, logp = np.asarray(token), np.asarray(logp)
            return cache, token, logp, start, time.monotonic()  # the device work's interval

        engine.cache, sampled, logps, start, end = await loop.run_in_executor(engine.executor, run)
        engine.stats.decode_s += end - start
        engine.stats.decode_steps += 1
        engine.stats.busy_slot_steps += len(busy)
        engine.ledger.charge_decode(owners, start, end, len(busy))
        for slot, req in enumerate(engine.active):
            if req is not None:
                engine.append(slot, int(sampled[slot]), float(logps[slot]), version)


def decode_inputs(engine: DecodeHost):
    """The decode step's per-slot arrays from the active requests (idle slots: dropped writes),
    led by the slots' page tables (None with slot rows); and the busy slots' positions."""
    slots = engine.slots
    tokens = np.zeros(slots, np.int32)
    positions = np.full(slots, engine.max_len, np.int32)  # idle: the write is dropped
    temperature = np.ones(slots, np.float32)
    top_k = np.zeros(slots, np.int32)
    top_p = np.ones(slots, np.float32)
    seeds = np.zeros(slots, np.uint32)
    counters = np.zeros(slots, np.int32)
    for slot, req in enumerate(engine.active):
        if req is not None:
            seeds[slot] = req.seed
            counters[slot] = len(req.generated)
            tokens[slot] = req.generated[-1]
            positions[slot] = len(req.prompt) + len(req.generated) - 1
            temperature[slot] = req.sampling.temperature
            top_k[slot] = req.sampling.top_k
            top_p[slot] = req.sampling.top_p
    arrays = (tokens, positions, seeds, counters, temperature, top_k, top_p)
    table = engine.kv.decode_table([i if r is not None else None for i, r in enumerate(engine.active)])
    return (table,) + arrays, [int(p) for p in positions if p < engine.max_len]
