"""Scheduler policy: pure functions (hypothesis laws), and the Scheduler over fake engines that
model a KV cache and preempt when it overflows (fakes for the policy itself; the real vLLM and
JaxEngine paths are in test_vllm_engine.py)."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_jax.rollout.engines.base import Completion, Engine, ServerLoad
from rstar2_jax.rollout.engines.vllm_engine.client import ServerUnavailable
from rstar2_jax.rollout.engines.sampling import SamplingParams
from rstar2_jax.rollout.engines.scheduler import Scheduler
from rstar2_jax.rollout.engines.scheduler_policies import (POLICIES, EngineLoad, pick_kv_aware, pick_least_requests,
                                                   pick_round_robin, pick_with_affinity, reservation)

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
        self.prefixes = {}               # session -> tokens of it this engine holds (its prefix cache)
        self.queries = self.hits = 0

    def load(self):
        return ServerLoad(kv_usage=self.used / self.capacity, kv_capacity_tokens=self.capacity,
                          prefix_cache_queries=self.queries, prefix_cache_hits=self.hits)

    async def generate(self, prompt_ids, sampling, stop=(), *, session=None):
        if self.fail:
            raise ServerUnavailable("down")
        self.queries += len(prompt_ids)
        self.hits += min(self.prefixes.get(session, 0), len(prompt_ids))
        self.prefixes[session] = len(prompt_ids) + sampling.max_tokens
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


@given(loads_strategy, st.integers(1, 5000), st.integers(0, 100), st.integers(-1, 7), st.sampled_from(sorted(POLICIES)))
def test_affinity_keeps_the_home_engine_when_it_fits_else_defers_to_the_policy(loads, need, turn, home, policy):
    home = home if 0 <= home < len(loads) else None
    got = pick_with_affinity(POLICIES[policy], loads, need, turn, home)
    if home is not None and loads[home].healthy and loads[home].free_tokens >= need:
        assert got == home
    else:
        assert got == POLICIES[policy](loads, need, turn)


def _multi_turn(scheduler, sessions=16, turns=4, prompt=50, new=20):
    """Trajectories whose every turn extends the last (prompt grows by the turn's tokens)."""
    async def trajectory(s):
        length = prompt
        for _ in range(turns):
            await scheduler.generate([0] * length, SamplingParams(max_tokens=new), session=("traj", s))
            length += new + 10  # the turn's tokens and a tool response
    async def main():
        await asyncio.gather(*(trajectory(s) for s in range(sessions)))
    asyncio.run(main())


def test_affinity_keeps_trajectories_where_their_prefix_is_cached():
    engines = [FakeKVEngine(capacity=2000, duration=0.005) for _ in range(4)]
    scheduler = Scheduler(engines, "kv_aware", refresh_s=0.0)
    _multi_turn(scheduler)
    assert scheduler.stayed == 16 * 3 and scheduler.spilled == 0  # every later turn went home
    # so every later turn finds its whole previous turn cached: (70 + 100 + 130) / (50 + 80 + 110 + 140)
    assert scheduler.prefix_cache_hit_rate() == pytest.approx(300 / 380)


def test_without_affinity_kv_aware_moves_a_trajectory_off_its_prefix():
    """Other work lands on the engine a trajectory just used, so it is no longer the emptiest:
    kv_aware alone moves the next turn away (re-prefilling it), affinity keeps it home."""
    rates = {}
    for affinity in (True, False):
        engines = [FakeKVEngine(capacity=5000, duration=0.0) for _ in range(2)]
        scheduler = Scheduler(engines, "kv_aware", refresh_s=0.0, affinity=affinity)

        async def main(scheduler=scheduler):
            length, last = 50, None
            for _ in range(4):
                if last is not None:
                    scheduler.loads[last].reserved_tokens += 500  # someone else's turn arrives there
                await scheduler.generate([0] * length, SamplingParams(max_tokens=20), session="t")
                last = scheduler._homes["t"]
                length += 30
        asyncio.run(main())
        rates[affinity] = scheduler.prefix_cache_hit_rate()
    assert rates[True] == pytest.approx(300 / 380) and rates[False] < rates[True] - 0.2, rates


def test_a_full_home_spills_to_the_policy_and_the_session_moves():
    engines = [FakeKVEngine(capacity=1000, duration=0.0), FakeKVEngine(capacity=1000, duration=0.0)]
    scheduler = Scheduler(engines, "kv_aware", refresh_s=0.0)

    async def main():
        await scheduler.generate([0] * 10, SamplingParams(max_tokens=10), session="a")
        home = scheduler._homes["a"]
        scheduler.loads[home].reserved_tokens += 990  # someone else fills the home engine
        await scheduler.generate([0] * 30, SamplingParams(max_tokens=10), session="a")
        scheduler.loads[home].reserved_tokens -= 990
        return home
    home = asyncio.run(main())
    assert scheduler.spilled == 1 and scheduler._homes["a"] == 1 - home


def test_server_load_reads_vllm_prefix_cache_counters():
    from rstar2_jax.rollout.engines.vllm_engine.client import server_load
    text = ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 800.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    load = server_load(text)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (2000, 1000)
