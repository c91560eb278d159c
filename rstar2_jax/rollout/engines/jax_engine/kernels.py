"""The JaxEngine's device work: the jitted prefill, extend, paged fill and decode steps (pure
functions of the weights, the cache and the step's arrays). The engine (jax_engine/engine.py) decides
what runs when and where each request's KV lives; these only compute. Every kernel samples the
next token with a key derived on device from the request's seed and token index, so a row's
sample never depends on what else shares the batch. The cache is donated: updated in place,
never copied per step."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.kv_cache import KVCache, init_cache
from rstar2_jax.rollout.engines.sampling import sample


class DecodeCarry(NamedTuple):
    """Every slot's decode state between chunks, kept on the device (jax_engine/decode_chunks.py)."""
    tokens: jax.Array      # int32 [S]: the slot's last sampled token, fed by its next step
    positions: jax.Array   # int32 [S]: where that token's KV is written (the idle position: dropped)
    counters: jax.Array    # int32 [S]: the index of the slot's next sample (its key)
    remaining: jax.Array   # int32 [S]: samples left before the budget or the KV room ends it
    active: jax.Array      # bool [S]


def _row_keys(seeds, counters):
    # one key per row, derived on device: a row's sample depends only on its own seed
    # and position, never on what else shares the batch
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def _run_and_sample(graphdef, state, tokens, start, length, cache, seed, counter, temperature, top_k, top_p):
    """Run `tokens` (the first `length` real) at positions start.. against `cache` and
    sample the next token (the request's `counter`-th) from the last real one."""
    model = nnx.merge(graphdef, state)
    positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits, cache = model(tokens, positions, cache=cache)
    last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, 0, keepdims=True)
    token, logp = sample(last, _row_keys(seed[None], counter[None]), temperature[None], top_k[None],
                         top_p[None])
    return cache, token[0], logp[0]


def _fill_row(graphdef, state, cache: KVCache, row: KVCache, slot, tokens, start, length, *sampling):
    """`_run_and_sample` on `row`, then write the row into the cache at `slot`."""
    row, token, logp = _run_and_sample(graphdef, state, tokens, start, length, row, *sampling)
    keys = tuple(jax.lax.dynamic_update_slice_in_dim(k, r, slot, 0) for k, r in zip(cache.keys, row.keys))
    values = tuple(jax.lax.dynamic_update_slice_in_dim(v, r, slot, 0)
                   for v, r in zip(cache.values, row.values))
    return KVCache(keys, values), token, logp


def _prefill(graphdef, cfg: ModelConfig, state, cache: KVCache, slot, tokens, start, length, *sampling):
    """A whole prompt into a fresh row (start is 0)."""
    row = init_cache(cfg, 1, cache.max_len, dtype=cache.keys[0].dtype)
    return _fill_row(graphdef, state, cache, row, slot, tokens, start, length, *sampling)


def _extend(graphdef, state, cache: KVCache, slot, tokens, start, length, *sampling):
    """New tokens at positions start.. of a slot that already holds the KV of positions < start."""
    row = KVCache(tuple(jax.lax.dynamic_slice_in_dim(k, slot, 1, 0) for k in cache.keys),
                  tuple(jax.lax.dynamic_slice_in_dim(v, slot, 1, 0) for v in cache.values))
    return _fill_row(graphdef, state, cache, row, slot, tokens, start, length, *sampling)


def _fill_pages(graphdef, state, cache, page_row, tokens, start, length, *sampling):
    """Paged: tokens at positions start.. through one row's page table [1, pages_per_row]."""
    cache, token, logp = _run_and_sample(graphdef, state, tokens, start, length, cache._replace(page_table=page_row),
                                        *sampling)
    return cache._replace(page_table=None), token, logp


def _decode(graphdef, state, cache, page_table, tokens, positions, seeds, counters, temperature, top_k, top_p):
    """One token for every slot (page_table: the slots' tables when paged, else None)."""
    model = nnx.merge(graphdef, state)
    if page_table is not None:
        cache = cache._replace(page_table=page_table)
    logits, cache = model(tokens[:, None], positions[:, None], cache=cache)
    token, logp = sample(logits[:, 0], _row_keys(seeds, counters), temperature, top_k, top_p)
    if page_table is not None:
        cache = cache._replace(page_table=None)
    return cache, token, logp


def _decode_chunk(graphdef, state, cache, page_table, carry: DecodeCarry, fresh: DecodeCarry, take_fresh, seeds,
                 temperature, top_k, top_p, stop_ids, idle_position, steps, check_every=1):
    """Up to `steps` decode steps in one device loop. The carry is the last chunk's, with the
    slots the host changed (`take_fresh`) taken from `fresh`. A slot ends inside the loop on
    a token of its `stop_ids` row (EOS, single-token stops) or when its `remaining` runs
    out; the loop ends after `steps` or, checked every `check_every` steps (it divides
    `steps`), when no slot is live. Returns the cache, the carry, the sampled tokens and
    log-probs [steps, S], which of them are real (the slot was live) and the steps run.

    Why check_every: a loop that may end early on a device value is one whose trip count
    XLA does not know, and XLA's GPU runtime then copies the predicate to the host and
    waits for the device before every iteration (WhileThunk); steps between checks run as
    an inner loop of a known count, queued whole (and a command buffer can capture it).
    The steps run past the last live slot's end sample nothing real (the carry does not
    move, their KV writes go to the idle position and are dropped)."""
    model = nnx.merge(graphdef, state)
    if page_table is not None:
        cache = cache._replace(page_table=page_table)
    carry = jax.tree.map(lambda f, c: jnp.where(take_fresh, f, c), fresh, carry)
    slots = carry.tokens.shape[0]
    out = (jnp.zeros((steps, slots), jnp.int32), jnp.zeros((steps, slots), jnp.float32),
           jnp.zeros((steps, slots), bool))

    def step(loop):
        i, cache, c, (tokens, logps, real) = loop
        logits, cache = model(c.tokens[:, None], c.positions[:, None], cache=cache)
        token, logp = sample(logits[:, 0], _row_keys(seeds, c.counters), temperature, top_k, top_p)
        live = c.active
        remaining = c.remaining - live
        ends = live & (jnp.any(token[:, None] == stop_ids, axis=1) | (remaining <= 0))
        going = live & ~ends
        c = DecodeCarry(jnp.where(live, token, c.tokens), jnp.where(going, c.positions + 1, idle_position),
                        c.counters + live, remaining, going)
        out = (tokens.at[i].set(token), logps.at[i].set(logp), real.at[i].set(live))
        return i + 1, cache, c, out

    def block(loop):  # check_every steps, a loop of a count XLA knows (no host wait between them)
        return jax.lax.fori_loop(0, check_every, lambda _, inner: step(inner), loop)

    n, cache, carry, out = jax.lax.while_loop(lambda loop: (loop[0] < steps) & jnp.any(loop[2].active),
                                              step if check_every == 1 else block,
                                              (jnp.int32(0), cache, carry, out))
    if page_table is not None:
        cache = cache._replace(page_table=None)
    return cache, carry, *out, n


class EngineKernels:
    """The five jitted steps over one model's graph (the weights are an argument: a weight swap
    recompiles nothing)."""

    def __init__(self, graphdef, cfg: ModelConfig):
        bound = functools.partial  # the graph (and config) are static: bound before jit, never traced
        self.prefill = jax.jit(bound(_prefill, graphdef, cfg), donate_argnums=(1,))
        self.extend = jax.jit(bound(_extend, graphdef), donate_argnums=(1,))
        self.fill_pages = jax.jit(bound(_fill_pages, graphdef), donate_argnums=(1,))
        self.decode = jax.jit(bound(_decode, graphdef), donate_argnums=(1,))
        self.decode_chunk = jax.jit(bound(_decode_chunk, graphdef), donate_argnums=(1,),
                                    static_argnames=("steps", "check_every"))


@functools.lru_cache(maxsize=16)
def engine_kernels(graphdef, cfg: ModelConfig) -> EngineKernels:
    """The process's one EngineKernels per (graph, model config): an engine built after another
    over the same model (the evaluation after RL, the tests' engines) compiles nothing again
    (core/shared_jit.py says why; the kernels close over these two only)."""
    return EngineKernels(graphdef, cfg)
