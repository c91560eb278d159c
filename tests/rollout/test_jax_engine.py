"""JaxEngine: agreement with the model, stops, slot refill, weight updates."""

import asyncio
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar2_jax import models
from rstar2_jax.models.generate import generate
from rstar2_jax.rollout.engines import JaxEngine, PromptTooLong
from rstar2_jax.rollout.engines.jax_engine.settings import JaxEngineSettings
from rstar2_jax.rollout.engines.sampling import SamplingParams


def _run(coro):
    return asyncio.run(coro)


def test_greedy_completions_equal_the_reference_generator(tiny_model, tokenizer):
    prompts = [tokenizer.encode(f"problem {i}: {'x' * i}") for i in range(7)]

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=3, max_len=128) as eng:
            return await asyncio.gather(*(eng.generate(p, SamplingParams(max_tokens=20, temperature=0.0)) for p in prompts))

    outs = _run(go())
    ref = generate(tiny_model, prompts, max_new_tokens=20, temperature=0.0)
    for out, want in zip(outs, ref.token_ids):
        assert out.token_ids == want[:len(out.token_ids)]
        assert out.finish_reason == ("eos" if out.token_ids[-1] in tiny_model.cfg.eos_token_ids else "length")


def test_sampled_logprobs_equal_the_models_log_softmax(tiny_model, tokenizer):
    """Engine log-probs (prefill + cached decode, continuous batching) == the learner's
    recomputation over the full sequence at the same temperature."""
    prompts = [tokenizer.encode("a" * n) for n in (3, 17, 40)]

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=128, seed=3) as eng:
            return await asyncio.gather(*(eng.generate(p, SamplingParams(max_tokens=30, temperature=0.7))
                                          for p in prompts))

    learner_logprobs = nnx.jit(lambda m, seq: models.token_logprobs(m, seq, temperature=0.7))
    for prompt, out in zip(prompts, _run(go())):
        seq = jnp.asarray([prompt + out.token_ids], jnp.int32)
        lp = np.asarray(learner_logprobs(tiny_model, seq))[0, len(prompt):]
        np.testing.assert_allclose(out.logprobs, lp, atol=2e-4)


def test_stop_strings_single_token_and_multi_token(tiny_model, tokenizer):
    """Greedy paths are deterministic: stopping at a string seen in the free run must cut the
    completion exactly where that string first appears (one-token and multi-token strings)."""
    greedy = SamplingParams(max_tokens=150, temperature=0.0)
    prompt = tokenizer.encode("x")

    async def go(stops):
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=256) as eng:
            return [await eng.generate(prompt, greedy, stop=stop) for stop in stops]

    (free,) = _run(go([()]))
    def printable(t):
        text = tokenizer.decode([t])
        return len(text) == 1 and text.isascii() and text.isprintable()

    ascii_at = [i for i, t in enumerate(free.token_ids) if printable(t) and i >= 2]
    pairs = [i for i in ascii_at if i + 1 in ascii_at]
    assert ascii_at and pairs, "the greedy run has no printable ASCII to stop on"
    single = tokenizer.decode([free.token_ids[ascii_at[0]]])
    double = tokenizer.decode(free.token_ids[pairs[0]:pairs[0] + 2])
    assert len(tokenizer.encode(single)) == 1 and len(tokenizer.encode(double)) == 2
    stopped_single, stopped_double = _run(go([(single,), (double,)]))
    for stop, got in ((single, stopped_single), (double, stopped_double)):
        first = next(k for k in range(1, len(free.token_ids) + 1)
                     if tokenizer.decode(free.token_ids[:k]).endswith(stop))
        assert got.finish_reason == "stop" and got.stop_string == stop
        assert got.token_ids == free.token_ids[:first]


def test_more_requests_than_slots_all_finish_and_slots_refill(tiny_model, tokenizer):
    busy = []

    async def go():
        # 128: the greedy test's shape (the engine's kernels are the process's: nothing new to compile)
        async with JaxEngine(tiny_model, tokenizer, slots=3, max_len=128) as eng:
            async def watch():
                while True:
                    busy.append(eng.busy_slots)
                    await asyncio.sleep(0)

            w = asyncio.create_task(watch())
            outs = await asyncio.gather(*(eng.generate(tokenizer.encode(str(i)), SamplingParams(max_tokens=5 + i % 7))
                                          for i in range(20)))
            w.cancel()
            return outs, eng.steps

    outs, steps = _run(go())
    assert len(outs) == 20 and all(o.token_ids for o in outs)
    assert max(busy) == 3
    total = sum(len(o.token_ids) for o in outs)
    assert steps < total  # batched: fewer decode steps than tokens


def test_context_full_ends_length_and_a_prompt_too_long_fails_only_its_request(tiny_model, tokenizer):
    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=32) as eng:
            full, too_long, other = await asyncio.gather(
                eng.generate([5] * 28, SamplingParams(max_tokens=100, temperature=0.0), stop=()),
                eng.generate([5] * 40, SamplingParams(max_tokens=10)),
                eng.generate([7] * 8, SamplingParams(max_tokens=6, temperature=0.0), stop=()),
                return_exceptions=True)
            no_room = await eng.generate([5] * 32, SamplingParams(max_tokens=10))
            after = await eng.generate([7] * 8, SamplingParams(max_tokens=6, temperature=0.0), stop=())
            return full, too_long, other, no_room, after

    full, too_long, other, no_room, after = _run(go())
    assert full.finish_reason in ("length", "eos") and 28 + len(full.token_ids) <= 32
    assert isinstance(too_long, PromptTooLong) and "40 tokens" in str(too_long) and "32" in str(too_long)
    # the engine goes on: the request beside it and one after it are served as usual
    assert other.token_ids and after.token_ids == other.token_ids
    assert no_room.finish_reason == "length" and no_room.token_ids == []


def test_update_weights_swaps_params_without_recompiling(tiny_model, tokenizer):
    other = models.Decoder(tiny_model.cfg, rngs=nnx.Rngs(99))
    prompt = tokenizer.encode("same prompt")

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=64) as eng:
            greedy = SamplingParams(max_tokens=12, temperature=0.0)
            before = await eng.generate(prompt, greedy)
            sizes = (eng.kernels.decode._cache_size(), eng.kernels.prefill._cache_size())
            eng.update_weights(nnx.state(other))
            after = await eng.generate(prompt, greedy)
            sizes_after = (eng.kernels.decode._cache_size(), eng.kernels.prefill._cache_size())
            with pytest.raises(ValueError, match="do not match"):
                eng.update_weights(nnx.state(models.Decoder(tiny_model.cfg.__class__(
                    **{**tiny_model.cfg.__dict__, "hidden_size": 64}), rngs=nnx.Rngs(0))))
            return before, after, sizes, sizes_after, eng.version

    before, after, sizes, sizes_after, version = _run(go())
    ref = generate(other, [prompt], max_new_tokens=12, temperature=0.0).token_ids[0]
    assert after.token_ids == ref[:len(after.token_ids)] and before.token_ids != after.token_ids
    assert sizes == sizes_after  # no new compilation
    assert (after.version_start, after.version_end, version) == (1, 1, 1)


@pytest.mark.parametrize("fails_in", ["the learner's copy", "the engine's placement"])
def test_a_sync_that_fails_mid_copy_leaves_the_last_whole_version(tiny_model, tokenizer, monkeypatch, fails_in):
    """Issue 70's bad input: a fault injected into the third tensor's device copy, either in the
    trainer's copy for the engine (processes.local_copy onto the engine's devices) or in the
    engine's own placement onto its mesh. The sync raises; the engine keeps serving its last whole
    version (same tokens as before, same version); the next sync lands whole."""
    from rstar2_jax.core import processes
    from rstar2_jax.rollout.engines import engine_mesh
    from rstar2_jax.core.sharding import param_shardings

    other = models.Decoder(tiny_model.cfg, rngs=nnx.Rngs(99))
    prompt = tokenizer.encode("same prompt")
    mesh = engine_mesh(own=True)  # a one-device mesh of its own: the engine places what it is given
    put = jax.device_put

    def faulty(x, *args, **kwargs):
        faulty.calls += 1
        if faulty.calls == 3:
            raise RuntimeError("injected fault: the link went down mid-copy")
        return put(x, *args, **kwargs)

    def sync(eng, state):
        if fails_in == "the learner's copy":
            state = processes.local_copy(state, shardings=param_shardings(state, mesh))
        eng.update_weights(state)

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=64, mesh=mesh) as eng:
            greedy = SamplingParams(max_tokens=12, temperature=0.0)
            before = await eng.generate(prompt, greedy)
            faulty.calls = 0
            monkeypatch.setattr(jax, "device_put", faulty)
            with pytest.raises(RuntimeError, match="injected fault"):
                sync(eng, nnx.state(other))
            monkeypatch.setattr(jax, "device_put", put)
            assert faulty.calls == 3  # it failed mid-copy, after two tensors went over
            still = await eng.generate(prompt, greedy)
            version_after_fault = eng.version
            sync(eng, nnx.state(other))
            after = await eng.generate(prompt, greedy)
            return before, still, version_after_fault, after, eng.version

    before, still, version_after_fault, after, version = _run(go())
    assert (still.token_ids, still.logprobs, version_after_fault) == (before.token_ids, before.logprobs, 0)
    ref = generate(other, [prompt], max_new_tokens=12, temperature=0.0).token_ids[0]
    assert after.token_ids == ref[:len(after.token_ids)] and after.token_ids != before.token_ids and version == 1


def test_seeded_requests_reproduce_whatever_else_is_batched(tiny_model, tokenizer):
    """Same seed, same tokens, alone or beside other requests; seeds past 32 bits are fine."""
    prompt = tokenizer.encode("seeded")
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=2 ** 40 + 7)

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=4, max_len=128) as eng:  # the owners test's shape
            alone = await eng.generate(prompt, sampling)
            crowd = await asyncio.gather(eng.generate(prompt, sampling),
                                         *(eng.generate(tokenizer.encode(f"other {i}"), SamplingParams(max_tokens=16))
                                           for i in range(3)))
            return alone, crowd[0]

    alone, crowded = _run(go())
    assert alone.token_ids == crowded.token_ids and alone.logprobs == pytest.approx(crowded.logprobs, abs=1e-6)


@pytest.mark.slow
def test_pallas_decode_gives_the_same_sampled_tokens(tiny_model, tokenizer):
    """The ragged Pallas decode kernels (rows and pages) change what a step reads, not what it
    samples: seeded completions and log-probs agree with XLA's full read."""
    prompts = [tokenizer.encode("b" * n) for n in (2, 30, 70)]
    sampling = [SamplingParams(max_tokens=40, temperature=0.8, seed=i) for i in range(3)]

    async def go(model, **kw):
        async with JaxEngine(model, tokenizer, slots=2, max_len=256, **kw) as eng:
            outs = await asyncio.gather(*(eng.generate(p, s) for p, s in zip(prompts, sampling)))
            return outs, eng.stats

    base, base_stats = _run(go(tiny_model))
    pallas_model = nnx.merge(*nnx.split(tiny_model)).set_attention(decode="pallas")
    ragged, stats = _run(go(pallas_model))
    paged, _ = _run(go(pallas_model, page_size=32))  # the Pallas paged kernel
    for want, *others in zip(base, ragged, paged):
        for got in others:
            assert got.token_ids == want.token_ids
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert stats.decode_steps == base_stats.decode_steps > 0
    assert 0.5 < stats.slot_utilization <= 1.0
    assert stats.busy_slot_steps == sum(len(o.token_ids) - 1 for o in base)  # first token is the prefill's


@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 16])
def test_precompile_compiles_the_decode_kernel_and_leaves_results_unchanged(tiny_model, tokenizer, decode_steps):
    prompt = tokenizer.encode("precompile me")
    greedy = SamplingParams(max_tokens=30, temperature=0.0)

    async def go(warm):
        eng = JaxEngine(tiny_model, tokenizer, slots=2, max_len=96, decode_steps=decode_steps)
        kernel = eng.kernels.decode if decode_steps == 1 else eng.kernels.decode_chunk  # the one it decodes with
        if warm:  # the kernels are the process's (core/shared_jit.py): count what this engine adds to them
            before = kernel._cache_size()
            eng.precompile([len(prompt)])
            compiled = kernel._cache_size()
        async with eng:
            out = await eng.generate(prompt, greedy)
        if warm:  # its one shape (no other test decodes at 2 x 96), then no new compile; a chunk is
            # entered twice (a NumPy carry, then a device one: two dispatch-cache entries)
            assert compiled - before == (1 if decode_steps == 1 else 2) and kernel._cache_size() == compiled
        return out.token_ids

    assert _run(go(True)) == _run(go(False))


def _turns(eng, tokenizer, sessions, turns=3, max_tokens=8):
    """Multi-turn trajectories: each next prompt = previous prompt + completion + a tool response."""
    async def one(s):
        prompt, outs = tokenizer.encode(f"question {s}:"), []
        for t in range(turns):
            c = await eng.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), session=("traj", s))
            outs.append(c)
            prompt = prompt + c.token_ids + tokenizer.encode(f"<tool_response>{t}</tool_response>")
        return outs
    return asyncio.gather(*(one(s) for s in sessions))


def test_kv_reuse_prefills_only_the_new_tokens_and_gives_the_same_turns(tiny_model, tokenizer):
    results, stats = {}, {}
    for reuse in (False, True):
        async def go(reuse=reuse):
            async with JaxEngine(tiny_model, tokenizer, slots=4, max_len=256, reuse_kv=reuse) as eng:
                out = await _turns(eng, tokenizer, range(3))
                return out, eng.stats
        results[reuse], stats[reuse] = _run(go())
    for plain, reused in zip(results[False], results[True]):
        for a, b in zip(plain, reused):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    # what was not prefilled again was reused, and most of each later turn's prompt was
    reused = stats[True].reused_tokens
    assert reused > 0 and stats[False].reused_tokens == 0
    assert stats[True].prefill_tokens + reused == stats[False].prefill_tokens
    assert stats[True].prefill_tokens < stats[False].prefill_tokens / 2


@pytest.mark.slow
def test_kv_reuse_never_uses_kv_of_older_weights_and_evicts_least_recently_used(tiny_model, tokenizer):
    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=256, reuse_kv=True) as eng:
            greedy = SamplingParams(max_tokens=6, temperature=0.0)
            p = tokenizer.encode("abc")
            c = await eng.generate(p, greedy, session="a")
            eng.update_weights(eng.state)  # same values, new version: the held KV is stale by rule
            await eng.generate(p + c.token_ids + [5], greedy, session="a")
            after_update = eng.stats.reused_tokens
            # three sessions through two slots: the oldest resident is dropped, results still right
            outs = await _turns(eng, tokenizer, range(3), turns=2)
            return after_update, outs
    after_update, outs = _run(go())
    assert after_update == 0
    async def plain():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=256) as eng:
            return await _turns(eng, tokenizer, range(3), turns=2)
    ref = _run(plain())
    assert [[c.token_ids for c in o] for o in outs] == [[c.token_ids for c in o] for o in ref]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_sync_mid_request_reaches_it_between_decode_steps_and_versions_are_per_token(tiny_model, tokenizer,
                                                                                     decode_steps):
    """Partial rollouts: a request in flight when the weights change continues with the new ones
    from the next decode step on (decoding in chunks: the next chunk), and each token records the
    version that sampled it."""
    other = models.Decoder(tiny_model.cfg, rngs=nnx.Rngs(7))
    prompt = tokenizer.encode("a long answer")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)

    async def go(swap_after):
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=128, eos_ids=(),
                             decode_steps=decode_steps) as eng:
            request = asyncio.ensure_future(eng.generate(prompt, greedy))
            if swap_after is not None:
                while eng.steps < swap_after:
                    await asyncio.sleep(0)
                eng.update_weights(nnx.state(other), version=1)
            return await request

    straight = _run(go(None))
    swapped = _run(go(10))
    versions = list(swapped.token_versions)
    first_new = versions.index(1)
    assert versions == [0] * first_new + [1] * (len(versions) - first_new) and first_new >= 10
    assert (first_new - 1) % decode_steps == 0  # the prefill's token, then whole chunks on the old weights
    assert (swapped.version_start, swapped.version_end) == (0, 1)
    # the KV computed before the swap is kept: every token, old weights or new, read version 0's KV
    assert list(swapped.token_kv_versions) == [0] * len(versions) and set(straight.token_kv_versions) == {0}
    assert swapped.token_ids[:first_new] == straight.token_ids[:first_new]  # old weights up to the swap ...
    assert swapped.token_ids[first_new:] != straight.token_ids[first_new:]  # ... the new ones after it
    assert set(straight.token_versions) == {0} and len(straight.token_ids) == 40


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_with_inflight_kv_recompute_a_swap_prefills_the_context_again_with_the_new_weights(tiny_model, tokenizer,
                                                                                          decode_steps):
    """rollout.jax.inflight_kv=recompute (issue 70 item 3): at the swap, a request in flight gives
    up the KV its old weights computed; the new weights prefill its context again, so what follows
    is exactly the new model's continuation of the tokens sampled so far, and every later token's
    KV is the new version's."""
    other = models.Decoder(tiny_model.cfg, rngs=nnx.Rngs(7))
    prompt = tokenizer.encode("a long answer")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=128, eos_ids=(), decode_steps=decode_steps,
                             inflight_kv="recompute") as eng:
            request = asyncio.ensure_future(eng.generate(prompt, greedy))
            while eng.steps < 10:
                await asyncio.sleep(0)
            eng.update_weights(nnx.state(other), version=1)
            return await request, eng.stats.preemptions

    swapped, preemptions = _run(go())
    versions = list(swapped.token_versions)
    first_new = versions.index(1)
    assert versions == [0] * first_new + [1] * (40 - first_new) and first_new >= 10 and preemptions == 1
    assert list(swapped.token_kv_versions) == [0] * first_new + [1] * (40 - first_new)
    before = prompt + swapped.token_ids[:first_new]
    ref = generate(other, [before], max_new_tokens=40 - first_new, temperature=0.0).token_ids[0]
    assert swapped.token_ids[first_new:] == ref


# ----------------------------------------------------------------------------------------------
# paged KV

def _pool_is_whole(eng):
    """Every page is free or held by a running row or a resident: none leaked, none shared."""
    pool = eng.kv.pool
    held = [p for owner in pool.owners() for p in pool.held(owner)]
    rows = {("row", i) for i, r in enumerate(eng.active) if r is not None}
    residents = {("resident", s) for s in eng.residents}
    return (len(held) == len(set(held)) and pool.free + len(held) == pool.num_pages
            and set(pool.owners()) <= rows | residents)


def _many(tokenizer, n=10, seeded=False):
    prompts = [tokenizer.encode(f"problem {i}: {'y' * (3 * i)}") for i in range(n)]
    sampling = [SamplingParams(max_tokens=24 + i, temperature=0.9 if seeded else 0.0, seed=i if seeded else None)
                for i in range(n)]
    return prompts, sampling


async def _serve(eng, prompts, sampling):
    """Run the requests, recording the most slots busy and the most pages held at once."""
    peak = {"busy": 0, "pages": 0}

    async def watch():
        while True:
            peak["busy"] = max(peak["busy"], eng.busy_slots)
            if eng.page_size:
                peak["pages"] = max(peak["pages"], eng.kv.pool.num_pages - eng.kv.pool.free)
            await asyncio.sleep(0)

    w = asyncio.create_task(watch())
    outs = await asyncio.gather(*(eng.generate(p, s) for p, s in zip(prompts, sampling)))
    w.cancel()
    return outs, peak


@pytest.mark.parametrize("seeded", [False, True])
def test_paged_kv_gives_the_tokens_slot_rows_give(tiny_model, tokenizer, seeded):
    prompts, sampling = _many(tokenizer, seeded=seeded)

    async def go(**kw):
        async with JaxEngine(tiny_model, tokenizer, slots=3, max_len=128, **kw) as eng:
            outs, _ = await _serve(eng, prompts, sampling)
            assert not kw or _pool_is_whole(eng)
            return outs

    rows, paged = _run(go()), _run(go(page_size=16))
    for want, got in zip(rows, paged):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_paged_memory_follows_live_tokens_and_admission_waits_for_free_pages(tiny_model, tokenizer):
    """Eight slots over the memory of ONE max_len row: short requests all run at once; long
    ones are admitted only while their prompts' pages are free, and nothing changes the tokens."""
    prompts = [tokenizer.encode(f"p{i}") for i in range(8)]
    sampling = [SamplingParams(max_tokens=12, temperature=0.0)] * 8  # <= 16 positions: one page each

    async def go(prompts, **kw):
        async with JaxEngine(tiny_model, tokenizer, max_len=256, **kw) as eng:
            outs, peak = await _serve(eng, prompts, sampling)
            assert not kw.get("page_size") or _pool_is_whole(eng)
            return outs, peak, eng.stats, eng.load()

    want, _, _, _ = _run(go(prompts, slots=8))
    got, peak, stats, load = _run(go(prompts, slots=8, page_size=16, kv_pages=16))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert peak["busy"] == 8 and stats.preemptions == 0  # all eight live in 16 x 16 = 256 positions
    assert load.kv_capacity_tokens == 256 and load.kv_usage == 0 and load.running == 0

    long_prompts = [p + tokenizer.encode("z" * 90) for p in prompts]  # 7 pages each: two fit at a time
    assert all(97 <= len(p) + 12 <= 112 for p in long_prompts)
    want, _, _, _ = _run(go(long_prompts, slots=8))
    got, peak, stats, _ = _run(go(long_prompts, slots=8, page_size=16, kv_pages=16))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert peak["busy"] <= 2 and peak["pages"] <= 16


@pytest.mark.parametrize("seeded", [False, True])
def test_preempted_requests_are_recomputed_and_sample_the_same_tokens(tiny_model, tokenizer, seeded):
    """Pages too few for every admitted request to finish: the newest is preempted (its pages
    freed) and readmitted later; its completion, log-probs and versions are those of a run
    that was never preempted."""
    prompts = [tokenizer.encode(f"q{i}") for i in range(6)]
    sampling = [SamplingParams(max_tokens=60, temperature=0.9 if seeded else 0.0, seed=i) for i in range(6)]

    async def go(**kw):
        async with JaxEngine(tiny_model, tokenizer, slots=6, max_len=128, eos_ids=(), **kw) as eng:
            outs, peak = await _serve(eng, prompts, sampling)
            assert not kw or _pool_is_whole(eng)
            return outs, peak, eng.stats

    want, _, _ = _run(go())
    got, peak, stats = _run(go(page_size=8, kv_pages=24))  # 6 x 64 positions wanted, 192 there
    assert stats.preemptions > 0 and peak["pages"] == 24
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 60
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        assert g.token_versions == w.token_versions


def test_paged_kv_reuse_keeps_a_trajectory_s_pages_whichever_slot_its_next_turn_gets(tiny_model, tokenizer):
    """Six trajectories through two slots: slot rows lose almost every resident to the queue,
    pages keep them (until pages run short, when the least recently used go), and the turns
    are those of a plain engine."""
    async def go(**kw):
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=64, **kw) as eng:  # turns end <= 44 tokens
            outs = await _turns(eng, tokenizer, range(6))
            assert not kw.get("page_size") or _pool_is_whole(eng)
            return outs, eng.stats

    plain, _ = _run(go())
    rows, row_stats = _run(go(reuse_kv=True))
    paged, paged_stats = _run(go(reuse_kv=True, page_size=8, kv_pages=64))  # room for all six
    tight, tight_stats = _run(go(reuse_kv=True, page_size=8, kv_pages=20))  # not: residents are evicted
    for run in (rows, paged, tight):
        assert [[c.token_ids for c in o] for o in run] == [[c.token_ids for c in o] for o in plain]
    later_prompts = paged_stats.prefill_tokens + paged_stats.reused_tokens - sum(
        len(tokenizer.encode(f"question {s}:")) for s in range(6))
    assert paged_stats.reused_tokens > 0.7 * later_prompts  # most of every later turn is reused
    assert paged_stats.reused_tokens > 3 * row_stats.reused_tokens
    assert 0 < tight_stats.reused_tokens < paged_stats.reused_tokens


def test_a_sync_mid_request_reaches_paged_rows_too(tiny_model, tokenizer):
    other = models.Decoder(tiny_model.cfg, rngs=nnx.Rngs(7))
    prompt = tokenizer.encode("a long answer")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)

    async def go(page_size):
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=128, eos_ids=(), page_size=page_size,
                             decode_steps=4) as eng:  # chunks short enough for the swap to land mid-request
            request = asyncio.ensure_future(eng.generate(prompt, greedy))
            while eng.steps < 10:
                await asyncio.sleep(0)
            eng.update_weights(nnx.state(other), version=1)
            return await request

    rows, paged = _run(go(None)), _run(go(16))
    assert paged.token_ids == rows.token_ids and paged.token_versions == rows.token_versions
    assert set(paged.token_versions) == {0, 1}


def test_paged_settings_are_checked_by_the_config_s_own_rules(tiny_model, tokenizer):
    """Issue 82: the engine reads rollout.jax.*'s rules (kind.setting_problems), not a copy."""
    with pytest.raises(ValueError, match=r"page_size: 16 must divide rollout.max_len=100"):
        JaxEngine(tiny_model, tokenizer, max_len=100, page_size=16)
    with pytest.raises(ValueError, match="cannot hold one max_len=128 sequence"):
        JaxEngine(tiny_model, tokenizer, max_len=128, page_size=16, kv_pages=7)
    with pytest.raises(ValueError, match=r"kv_pages: needs rollout.jax.page_size > 0"):
        JaxEngine(tiny_model, tokenizer, max_len=128, kv_pages=7)
    with pytest.raises(ValueError, match="slotz: unknown field; did you mean 'slots'"):
        JaxEngine(tiny_model, tokenizer, max_len=128, slotz=4)
    assert JaxEngine(tiny_model, tokenizer, max_len=128).settings.slots == JaxEngineSettings().slots  # one default
    eng = JaxEngine(tiny_model, tokenizer, slots=4, max_len=128, page_size=16)
    assert eng.load().kv_capacity_tokens == 4 * 128  # default: the rows' memory


@pytest.mark.parametrize("paged", [False, True])
def test_work_is_charged_to_the_owner_of_each_request_and_sums_to_the_engine_wide_figure(tiny_model, tokenizer,
                                                                                        paged):
    """Two RL steps' requests overlap in one engine (asynchronous rollouts): each step's counters
    are its own requests' (prompt tokens prefilled, slots held, decode steps that served it),
    they differ from the engine-wide figure, and the owners' shares add up to it exactly."""
    from rstar2_jax.rollout.engines.accounting import owned_by

    first = [tokenizer.encode(f"first {i} " + "a" * (5 * i)) for i in range(4)]
    second = [tokenizer.encode(f"second {i}") for i in range(3)]
    kw = dict(page_size=8, kv_pages=24) if paged else {}

    async def batch(eng, owner, prompts, tokens, delay):
        await asyncio.sleep(delay)
        with owned_by(owner):
            return await asyncio.gather(*(eng.generate(p, SamplingParams(max_tokens=tokens, temperature=0.0, seed=i))
                                          for i, p in enumerate(prompts)))

    async def go():
        async with JaxEngine(tiny_model, tokenizer, slots=4, max_len=128, eos_ids=(), **kw) as eng:
            a, b = await asyncio.gather(batch(eng, "step 0", first, 50, 0.0), batch(eng, "step 1", second, 10, 0.05))
            return a, b, eng.stats, eng.take_owned("step 0"), eng.take_owned("step 1"), eng.take_owned("step 0")

    a, b, total, work_a, work_b, again = _run(go())
    for outs, prompts, work in ((a, first, work_a), (b, second, work_b)):
        if not paged:  # one admission per request: its prompt prefilled once, one slot-step per later token
            assert work.stats.prefill_tokens == sum(len(p) for p in prompts)
            assert work.stats.own_slot_steps == sum(len(o.token_ids) - 1 for o in outs)
        assert 0 < work.stats.decode_steps <= total.decode_steps
        assert work.busy and work.stats.slot_utilization <= 1.0
    for field in ("prefill_tokens", "reused_tokens", "preemptions", "own_slot_steps"):
        assert getattr(work_a.stats, field) + getattr(work_b.stats, field) == getattr(total, field) or \
            field == "own_slot_steps" and total.own_slot_steps == 0
    assert work_b.stats.decode_steps < total.decode_steps  # the short step's figure is not the engine-wide one
    assert work_a.stats.own_slot_steps + work_b.stats.own_slot_steps == total.busy_slot_steps
    assert work_a.stats.decode_steps + work_b.stats.decode_steps >= total.decode_steps  # shared steps count twice
    assert work_a.stats.prefill_s + work_b.stats.prefill_s == pytest.approx(total.prefill_s)
    if paged:
        assert total.preemptions > 0
    assert again.stats.decode_steps == 0 and again.busy == []  # taken once, then forgotten


def test_the_engine_offers_what_its_layouts_and_decode_loops_ask_for(tiny_model, tokenizer):
    """slot_requests.SlotOwner / DecodeHost: the whole of what jax_engine/kv_layouts.py, jax_engine/decode_step.py and
    jax_engine/decode_chunks.py may use of the engine (they import those, never the engine), and the engine
    has each member."""
    import inspect

    from rstar2_jax.rollout.engines.jax_engine import decode_chunks
    from rstar2_jax.rollout.engines.jax_engine import decode_step
    from rstar2_jax.rollout.engines.jax_engine import kv_layouts
    from rstar2_jax.rollout.engines.jax_engine.slot_requests import DecodeHost, SlotOwner

    members = {name for proto in (SlotOwner, DecodeHost) for klass in proto.__mro__ if klass not in (object,)
               for name in (*getattr(klass, "__annotations__", {}), *vars(klass)) if not name.startswith("_")}
    engine = JaxEngine(tiny_model, tokenizer, slots=2, max_len=64)
    assert not [m for m in members if not hasattr(engine, m)]
    used = set()
    for module in (kv_layouts, decode_step, decode_chunks):  # `engine.<name>` in their source
        used |= set(re.findall(r"(?<![\w/])engine\.(?!py\b)(\w+)", inspect.getsource(module)))  # not "engine.py"
    assert used <= members, f"used but not in the interface: {sorted(used - members)}"
    asyncio.run(engine.close())
