"""Per-row sampling (temperature, top-k, top-p, greedy) with the sampler's log-probs.

The log-prob returned for a token is under the *unmodified* distribution at the sampling
temperature, log_softmax(logits / T)[token], before top-k/top-p truncation: that is the
distribution the learner recomputes, so the importance ratio compares like with like.
Greedy rows (T <= 0) report log_softmax(logits)[argmax].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0: off
    stop: tuple[str, ...] = ()
    seed: int | None = None   # set: token i is drawn with fold_in(key(seed), i), whatever the batching

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample(logits: jax.Array, rng: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [S, V]; temperature, top_p float [S]; top_k int [S]. Returns (tokens, logprobs) [S].

    rng: one key for the whole batch, or one key per row (shape [S]) so that a row's sample does
    not depend on which other rows share the batch.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logp = jax.nn.log_softmax(scaled, axis=-1)

    # The vocabulary sort is the costliest part of a decode step's sampling: skip it when no
    # row truncates (plain temperature sampling or greedy, the usual RL setting).
    truncating = jnp.any(top_k > 0) | jnp.any(top_p < 1)
    keep = jax.lax.cond(truncating, _top_k_top_p_keep, lambda s, k, p: jnp.ones(s.shape, bool),
                        scaled, top_k, top_p)
    candidates = jnp.where(keep, scaled, -jnp.inf)
    if rng.ndim == 1:  # per-row keys
        sampled = jax.vmap(lambda k, row: jax.random.categorical(k, row))(rng, candidates)
    else:
        sampled = jax.random.categorical(rng, candidates, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _top_k_top_p_keep(scaled, top_k, top_p):
    """Which tokens survive each row's top-k, then top-p over what top-k kept. bool [S, V]."""
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = scaled.shape[-1]
    kth = jnp.take_along_axis(ordered, (jnp.clip(top_k, 1, vocab) - 1)[:, None], axis=-1)
    keep = jnp.where((top_k > 0)[:, None], scaled >= kth, True)
    # top-p: the smallest prefix of the sorted distribution with mass >= p
    ordered_kept = jnp.where(jnp.where((top_k > 0)[:, None], ordered >= kth, True), ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered_kept, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = mass_before < top_p[:, None]
    threshold = jnp.min(jnp.where(in_nucleus, ordered_kept, jnp.inf), axis=-1, keepdims=True)
    return keep & (scaled >= threshold)
