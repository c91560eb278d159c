"""Chunked decode (decode_steps > 1, rollout/engines/jax_engine/decode_chunks.py) against one step per
dispatch: the same tokens, log-probs and per-token versions on both KV layouts, with stop strings
of one and of several tokens, prefix reuse and preemption (issue 70). A weight swap mid-request:
tests/rollout/test_jax_engine.py, at one step and at four per dispatch."""

import asyncio
import re
import signal

import numpy as np
import pytest

from flax import nnx

from rstar2_jax import models
from rstar2_jax.rollout.engines import JaxEngine
from rstar2_jax.rollout.engines.jax_engine import weight_swap
from rstar2_jax.rollout.engines.sampling import SamplingParams
from tests.rollout.test_jax_engine import _pool_is_whole, _serve, _turns


@pytest.fixture(autouse=True)
def fail_rather_than_hang():
    """A chunk loop that loses track of a slot (say, a new request's state never reaching the
    device) leaves its request waiting forever: fail the test instead (each takes < 60 s here)."""
    def expired(*_):
        raise TimeoutError("the engine stopped serving its requests")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _same(want, got, atol=1e-5):
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.finish_reason, g.stop_string) == (w.token_ids, w.finish_reason, w.stop_string)
        assert g.token_versions == w.token_versions and g.token_kv_versions == w.token_kv_versions
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=atol)


def _requests(tokenizer, n=10):
    prompts = [tokenizer.encode(f"problem {i}: {'y' * (3 * i)}") for i in range(n)]
    sampling = [SamplingParams(max_tokens=20 + 2 * i, temperature=0.9 if i % 3 else 0.0, seed=i) for i in range(n)]
    return prompts, sampling


@pytest.mark.parametrize("kv", [{}, {"page_size": 16}], ids=["slot_rows", "paged"])
def test_chunks_give_the_tokens_of_one_step_per_dispatch(tiny_model, tokenizer, kv):
    prompts, sampling = _requests(tokenizer)
    # a one-token stop (the device ends the slot) and a several-token one (the host matches it)
    stops = ["</tool_call>", "yy", "\n"]

    async def go(steps, exit_check=1):
        async with JaxEngine(tiny_model, tokenizer, slots=3, max_len=128, decode_steps=steps,
                             exit_check_steps=exit_check, **kv) as eng:
            outs = await asyncio.gather(*(eng.generate(p, s, stop=stops) for p, s in zip(prompts, sampling)))
            assert not kv or _pool_is_whole(eng)
            return outs, eng.stats

    (want, one), (got, chunked) = asyncio.run(go(1)), asyncio.run(go(8))
    _same(want, got)
    assert {o.finish_reason for o in want} >= {"length"}
    assert chunked.decode_steps >= one.decode_steps and chunked.busy_slot_steps >= one.busy_slot_steps
    # a chunk run whole (no check for a live slot before its end: the loop XLA knows the count of)
    # samples the same; it may run steps with no slot live, never a token more
    whole, whole_stats = asyncio.run(go(8, exit_check=8))
    _same(want, whole)
    assert whole_stats.busy_slot_steps == chunked.busy_slot_steps and whole_stats.decode_steps % 8 == 0


def test_a_chunk_run_whole_is_a_loop_of_a_known_trip_count(tiny_model, tokenizer):
    """exit_check_steps=K compiles the chunk's K steps as a loop XLA knows the count of (the GPU
    runtime queues such a loop without a device-to-host wait per step: WhileThunk); with a check
    every step the chunk's loop has none. (The sampler's random-bit loops have known counts of 5.)"""
    def trip_counts(check):
        eng = JaxEngine(tiny_model, tokenizer, slots=2, max_len=64, decode_steps=4, exit_check_steps=check)
        args, _, _ = eng.decoder._inputs(eng)
        hlo = eng.kernels.decode_chunk.lower(*args, steps=4, check_every=check).compile().as_text()
        eng.executor.shutdown()
        loops = [line for line in hlo.splitlines() if " while(" in line]
        return [m.group(1) if m else None
                for m in (re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line) for line in loops)]

    every, whole = trip_counts(1), trip_counts(4)
    assert every.count(None) == 1 and "4" not in every, every  # the chunk's loop: checked each step
    assert whole.count(None) == 1 and whole.count("4") == 1, whole  # a check per 4 steps around 4 known


def test_a_stop_string_of_several_tokens_is_matched_between_chunks(tiny_model, tokenizer):
    """The device cannot match "ab" spelled as two tokens: the host does, between chunks, cuts the
    completion where the string first appears and drops what the device sampled after it."""
    greedy = SamplingParams(max_tokens=120, temperature=0.0)
    prompt = tokenizer.encode("x")

    async def go(steps, stop=()):
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=256, decode_steps=steps) as eng:
            return await eng.generate(prompt, greedy, stop=stop)

    free = asyncio.run(go(1))
    texts = [tokenizer.decode(free.token_ids[i:i + 2]) for i in range(2, len(free.token_ids) - 1)]
    double = next(t for t in texts if len(t) == 2 and t.isascii() and t.isprintable()
                  and len(tokenizer.encode(t)) == 2)
    want, got = asyncio.run(go(1, (double,))), asyncio.run(go(16, (double,)))
    assert got.finish_reason == "stop" and got.stop_string == double
    _same([want], [got])


def test_prefix_reuse_over_chunks_gives_the_turns_of_a_plain_engine(tiny_model, tokenizer):
    async def go(steps, **kw):
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=64, decode_steps=steps, **kw) as eng:
            return await _turns(eng, tokenizer, range(4)), eng.stats

    (plain, _), (reused, stats) = asyncio.run(go(1)), asyncio.run(go(8, reuse_kv=True, page_size=8))
    assert stats.reused_tokens > 0
    for a, b in zip(plain, reused):
        assert [t.token_ids for t in a] == [t.token_ids for t in b]


def test_preempted_requests_over_chunks_sample_the_same_tokens(tiny_model, tokenizer):
    prompts = [tokenizer.encode(f"q{i}") for i in range(6)]
    sampling = [SamplingParams(max_tokens=60, temperature=0.9, seed=i) for i in range(6)]

    async def go(steps, **kw):
        async with JaxEngine(tiny_model, tokenizer, slots=6, max_len=128, eos_ids=(), decode_steps=steps, **kw) as eng:
            outs, _ = await _serve(eng, prompts, sampling)
            assert not kw or _pool_is_whole(eng)
            return outs, eng.stats

    want, _ = asyncio.run(go(1))
    got, stats = asyncio.run(go(8, page_size=8, kv_pages=24))
    assert stats.preemptions > 0
    _same(want, got)


def test_with_swap_landed_decoding_goes_on_with_the_old_weights_until_the_copy_lands(tiny_model, tokenizer,
                                                                                     monkeypatch):
    """rollout.jax.swap=landed (issue 70's in-flight update): weights given mid-request wait in a
    second buffer while the engine keeps decoding with the old ones, and take over at the first
    chunk boundary after their copy is on the device (here: declared landed at step 20); tokens
    record the version that sampled them, the request keeps its KV, and `weights_at_least` waits
    for the take-over. On an idle engine they take over at once."""
    other = models.Decoder(tiny_model.cfg, rngs=nnx.Rngs(7))
    prompt = tokenizer.encode("a long answer")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=128, eos_ids=(), decode_steps=4,
                             swap="landed") as eng:
            # the copy "lands" once 20 steps have run
            monkeypatch.setattr(weight_swap, "landed", lambda state: eng.steps >= 20)
            request = asyncio.ensure_future(eng.generate(prompt, greedy))
            while eng.steps < 8:
                await asyncio.sleep(0)
            eng.update_weights(nnx.state(other), version=1)
            pending_at = (eng.version, eng.steps)
            await eng.weights_at_least(1)
            out = await request
            eng.update_weights(nnx.state(tiny_model), version=2)  # idle: at once
            return out, pending_at, eng.version

    out, (version_then, steps_then), idle_version = asyncio.run(go())
    assert version_then == 0 and steps_then < 20
    versions = list(out.token_versions)
    first_new = versions.index(1)
    assert versions == [0] * first_new + [1] * (len(versions) - first_new)
    assert first_new > 20 and (first_new - 1) % 4 == 0  # after the copy landed, at a chunk boundary
    assert set(out.token_kv_versions) == {0} and idle_version == 2
    with pytest.raises(ValueError, match="unknown weight swap timing .sometime.; registered: landed, next_chunk"):
        JaxEngine(tiny_model, tokenizer, max_len=64, swap="sometime")
