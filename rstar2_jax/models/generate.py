"""Batched autoregressive sampling with the KV cache, in one jitted loop.

A minimal generator for demos, tests and evaluation of single prompts. The continuous-batching
rollout engine (rstar2_jax.rollout.engines) builds on the same cached forward.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models.kv_cache import init_cache


class Generation(NamedTuple):
    token_ids: list[list[int]]   # generated ids per prompt, up to and including EOS
    logprobs: list[list[float]]  # sampler log-prob of each generated id, at the sampling temperature


def sample_token(logits: jax.Array, rng: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """(token, log-prob) per row from float logits [B, V]; temperature 0 is greedy."""
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        token = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        token = jax.random.categorical(rng, logp, axis=-1)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


@nnx.jit(static_argnames=("max_new_tokens", "temperature", "eos_ids"))
def _generate(model: Decoder, tokens, lengths, rng, *, max_new_tokens: int, temperature: float,
              eos_ids: tuple[int, ...]):
    b, p = tokens.shape
    cache = init_cache(model.cfg, b, p + max_new_tokens, dtype=model.dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = model(tokens, positions, cache=cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def step(i, carry):
        cache, last, done, out_tokens, out_logp, rng = carry
        rng, key = jax.random.split(rng)
        token, logp = sample_token(last, key, temperature)
        out_tokens = out_tokens.at[:, i].set(jnp.where(done, -1, token))
        out_logp = out_logp.at[:, i].set(jnp.where(done, 0.0, logp))
        done = done | jnp.isin(token, eos)
        logits, cache = model(token[:, None], (lengths + i)[:, None], cache=cache)
        return cache, logits[:, 0], done, out_tokens, out_logp, rng

    init = (cache, last, jnp.zeros(b, bool), jnp.full((b, max_new_tokens), -1, jnp.int32),
            jnp.zeros((b, max_new_tokens), jnp.float32), rng)
    _, _, _, out_tokens, out_logp, _ = jax.lax.fori_loop(0, max_new_tokens, step, init)
    return out_tokens, out_logp


def generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 1.0, seed: int = 0, eos_ids: Sequence[int] | None = None) -> Generation:
    """Sample continuations of token-id prompts (a batch, right-padded internally)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos_ids = tuple(model.cfg.eos_token_ids if eos_ids is None else eos_ids)
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    out, logp = _generate(model, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed),
                          max_new_tokens=max_new_tokens, temperature=float(temperature), eos_ids=eos_ids)
    out, logp = np.asarray(out), np.asarray(logp)
    ids = [[int(t) for t in row if t >= 0] for row in out]
    return Generation(ids, [[float(x) for x in logp[i, :len(ids[i])]] for i in range(len(ids))])
