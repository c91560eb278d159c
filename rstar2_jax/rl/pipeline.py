"""The staleness-gated producer/consumer loop of RL steps, generic over what a step is.

    await run_pipeline(range(start, end), max_lag=k, draw=draw, consume=consume, exclusive=exclusive)

For each step in order the producer waits until the consumer has finished step s - 1 - k (or,
when `exclusive(s)`, every step before s), then awaits `draw(s)` (sequential: steps draw in
order) which returns an awaitable of the step's data (its rollouts), started at once as a
task; the consumer awaits the steps' data in order and calls `consume(s, data)`. So step s's
rollouts start only after the update of step s - 1 - k: no token is sampled by weights more than
k versions behind the update that trains on it, and with k = 0 the loop is the sequential one.

The producer runs under `processes.no_collectives`: a gather or barrier in a draw or in the
rollouts raises instead of deadlocking several processes. An exclusive draw (the consumer is
idle, waiting for this very step) may issue collectives; an offline pre-filter is one.

Errors end the loop from either side: a failed draw or rollout is raised by the consumer when it
reaches that step; a failed consume cancels the producer and every rollout in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, Sequence, TypeVar

import numpy as np

from rstar2_jax.core import processes

T = TypeVar("T")


async def run_pipeline(steps: Sequence[int], *, max_lag: int, draw: Callable[[int], Awaitable[Awaitable[T]]],
                       consume: Callable[[int, T], Awaitable[None]],
                       exclusive: Callable[[int], bool] = lambda step: False):
    if not steps:
        return
    start = steps[0]
    ready: asyncio.Queue = asyncio.Queue()
    trained = asyncio.Condition()
    done = start  # steps the consumer has finished
    launched: list[asyncio.Task] = []

    async def produce():
        with processes.no_collectives("the rollout producer"):
            try:
                for step in steps:
                    alone = exclusive(step)
                    after = step if alone else step - max_lag
                    async with trained:
                        await trained.wait_for(lambda after=after: done >= after)
                    with processes.no_collectives(None) if alone else contextlib.nullcontext():
                        data = await draw(step)
                    launched.append(asyncio.ensure_future(data))
                    ready.put_nowait(launched[-1])
            except BaseException as e:  # the consumer re-raises it; nothing waits forever
                ready.put_nowait(e)
                raise

    producer = asyncio.create_task(produce())
    try:
        for step in steps:
            item = await ready.get()
            if isinstance(item, BaseException):
                raise item
            await consume(step, await item)
            async with trained:
                done = step + 1
                trained.notify_all()
    finally:
        for task in (producer, *launched):
            task.cancel()
        for task in (producer, *launched):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def token_staleness(versions: Sequence[Sequence[int]], kv_versions: Sequence[Sequence[int]], learner_version: int,
                    bound: int, step: int, carried: int = 0) -> dict[str, float]:
    """How many versions each sampled token lags the learner about to train on it, by the
    weights that sampled it and by the oldest weights whose KV it read (a partial rollout keeps
    KV from before a sync); raises if either lags more than `bound` + `carried` (the pipeline's
    invariant; `carried`: 1 when groups may be carried into the next step, rl/carry.py), and
    counts the tokens past `bound` (kept and corrected)."""
    lags = [learner_version - v for vs in versions for v in vs if v >= 0]
    kv_lags = [learner_version - v for vs in kv_versions for v in vs if v >= 0]
    worst, kv_worst = max(lags, default=0), max(kv_lags, default=0)
    if max(worst, kv_worst) > bound + carried:
        raise RuntimeError(f"step {step}: a token sampled {worst} versions ago (KV {kv_worst} versions old) "
                           f"exceeds rl.max_staleness={bound}" + (" + 1 (a carried group)" if carried else ""))
    return {"staleness/max": float(worst), "staleness/mean": float(np.mean(lags)) if lags else 0.0,
            "staleness/kv_max": float(kv_worst), "staleness/over_bound_tokens": float(sum(v > bound for v in lags))}
