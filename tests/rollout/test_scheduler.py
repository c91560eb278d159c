"""Scheduler policy: pure functions (hypothesis laws), and the Scheduler over fake engines that
model a KV cache and preempt when it overflows (fakes for the policy itself; the real vLLM and
JaxEngine paths are in test_vllm_engine.py)."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_jax.rollout.engines.base import Completion, Engine, ServerLoad
from rstar2_jax.rollout.engines.vllm_client import ServerUnavailable
from rstar2_jax.rollout.sampling import SamplingParams
from rstar2_jax.rollout.scheduler import (EngineLoad, Scheduler, pick_kv_aware, pick_least_requests,
                                          pick_round_robin, reservation)

loads_strategy = st.lists(st.builds(EngineLoad, capacity_tokens=st.integers(1, 10_000),
                                    reserved_tokens=st.integers(0, 10_000), used_tokens=st.integers(0, 10_000),
                                    in_flight=st.integers(0, 50), healthy=st.booleans()), min_size=1, max_size=8)


@given(loads_strategy, st.integers(1, 12_000))
def test_kv_aware_places_only_where_it_fits_and_prefers_the_most_free(loads, need):
    i = pick_kv_aware(loads, need, 0)
    fitting = [l for l in loads if l.healthy and l.free_tokens >= need]
    if fitting:
        assert i is not None and loads[i].healthy and loads[i].free_tokens >= need
        assert loads[i].free_tokens == max(l.free_tokens for l in fitting)
    elif i is not None:  # only an oversized request, onto an idle engine
        assert all(need > l.capacity_tokens for l in loads if l.healthy)
        assert loads[i].healthy and loads[i].in_flight == 0


@given(loads_strategy, st.integers(0, 1000))
def test_baselines_pick_a_healthy_engine(loads, turn):
    for pick in (pick_round_robin, pick_least_requests):
        i = pick(loads, 1, turn)
        assert (i is None) == (not any(l.healthy for l in loads))
        if i is not None:
            assert loads[i].healthy
    i = pick_least_requests(loads, 1, turn)
    if i is not None:
        assert loads[i].in_flight == min(l.in_flight for l in loads if l.healthy)


def test_round_robin_cycles():
    loads = [EngineLoad(100) for _ in range(3)]
    assert [pick_round_robin(loads, 1, t) for t in range(6)] == [0, 1, 2, 0, 1, 2]


@given(st.integers(1, 5000), st.integers(0, 5000), st.none() | st.integers(0, 5000))
def test_reservation_is_prompt_plus_bounded_new_tokens(prompt, max_tokens, reserve):
    r = reservation(prompt, max_tokens, reserve)
    assert prompt <= r <= prompt + max_tokens
    assert (r == prompt + max_tokens) == (reserve is None or reserve >= max_tokens)


class FakeKVEngine(Engine):
    """A server with `capacity` KV tokens: each request holds prompt + max_tokens while it runs
    `duration` seconds; admitting past capacity counts a preemption (what vLLM would do)."""

    def __init__(self, capacity: int, duration: float = 0.02):
        self.capacity, self.duration = capacity, duration
        self.used = 0
        self.preemptions = 0
        self.served = 0
        self.version = 0
        self.fail = False

    def load(self):
        return ServerLoad(kv_usage=self.used / self.capacity, kv_capacity_tokens=self.capacity)

    async def generate(self, prompt_ids, sampling, stop=()):
        if self.fail:
            raise ServerUnavailable("down")
        need = len(prompt_ids) + sampling.max_tokens
        self.used += need
        if self.used > self.capacity:
            self.preemptions += 1
        await asyncio.sleep(self.duration)
        self.used -= need
        self.served += 1
        return Completion([1] * sampling.max_tokens, [0.0] * sampling.max_tokens, "length")

    def update_weights(self, params, version=None):
        self.version = version

    def take_busy_intervals(self):
        return []

    async def close(self):
        pass


def _run(scheduler, n, prompt_len=10, max_tokens=90):
    async def main():
        return await asyncio.gather(*(scheduler.generate([0] * prompt_len, SamplingParams(max_tokens=max_tokens))
                                      for _ in range(n)))
    return asyncio.run(main())


def test_kv_aware_never_preempts_while_round_robin_does():
    # capacities 1000 and 300 tokens, requests of 100: 13 fit at once; 40 requests
    kv = [FakeKVEngine(1000), FakeKVEngine(300)]
    out = _run(Scheduler(kv, "kv_aware", refresh_s=0.0), 40)
    assert len(out) == 40 and sum(e.served for e in kv) == 40
    assert sum(e.preemptions for e in kv) == 0
    rr = [FakeKVEngine(1000), FakeKVEngine(300)]
    _run(Scheduler(rr, "round_robin", refresh_s=0.0), 40)
    assert sum(e.preemptions for e in rr) > 0


def test_kv_aware_sends_more_to_the_larger_engine():
    engines = [FakeKVEngine(1000), FakeKVEngine(300)]
    s = Scheduler(engines, "kv_aware", refresh_s=0.0)
    _run(s, 40)
    assert s.dispatched[0] > 2 * s.dispatched[1] > 0


def test_failed_engine_requests_are_rerouted_exactly_once():
    engines = [FakeKVEngine(1000), FakeKVEngine(1000)]
    engines[1].fail = True
    s = Scheduler(engines, "round_robin", refresh_s=60.0)
    out = _run(s, 10)
    assert len(out) == 10 and engines[0].served == 10 and engines[1].served == 0
    assert s.rerouted >= 1
    assert all(l.in_flight == 0 and l.reserved_tokens == 0 for l in s.loads)


def test_all_engines_down_raises():
    engines = [FakeKVEngine(1000)]
    engines[0].fail = True
    with pytest.raises(ServerUnavailable):
        _run(Scheduler(engines, "kv_aware"), 1)


def test_update_weights_reaches_every_engine_and_version_is_the_oldest():
    engines = [FakeKVEngine(10), FakeKVEngine(10)]
    s = Scheduler(engines)
    s.update_weights(None, 7)
    assert [e.version for e in engines] == [7, 7] and s.version == 7
    engines[0].version = 6
    assert s.version == 6


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="policy"):
        Scheduler([FakeKVEngine(10)], "fastest")
