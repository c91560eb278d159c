"""Log-probabilities of given tokens without materialising [B, T, vocab] logits.

The sequence is cut into chunks of `chunk_size` positions; each chunk's logits are formed,
reduced to one log-prob per position, and dropped. The chunk function is rematerialised
(`jax.checkpoint`), so the backward pass also never holds more than one chunk of logits. With a
150k vocabulary and 12k-token responses this is the difference between ~7 GB and ~60 MB per
sequence of float32 logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# Positions whose logits one pass holds at a time (float32 [rows, chunk, vocab]): the learner's
# default (UpdateConfig.logprob_chunk) and what the memory plan counts.
LOGPROB_CHUNK = 512


@jax.custom_vjp
def _lm_head_logits(h: jax.Array, kernel: jax.Array) -> jax.Array:
    """h [B, C, E] @ kernel [E, V] -> float32 logits, accumulated in float32 from h's dtype."""
    return jnp.einsum("bce,ev->bcv", h, kernel, preferred_element_type=jnp.float32)


def _lm_head_fwd(h, kernel):
    return _lm_head_logits(h, kernel), (h, kernel)


def _lm_head_bwd(res, g):
    # The cotangent of float32 logits is float32; left alone, both backward matmuls (the two
    # largest of the model: [tokens x vocab x hidden]) run as fp32/tf32 GEMMs at half the bf16
    # rate (seen on an H100: 15% of a Qwen3-1.7B train step). Casting it to the compute dtype
    # keeps them on the bf16 tensor cores, as every other activation gradient already is.
    # With float32 compute this is the exact gradient.
    h, kernel = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("bcv,ev->bce", g, kernel, preferred_element_type=jnp.float32).astype(h.dtype)
    dk = jnp.einsum("bcv,bce->ev", g, h, preferred_element_type=jnp.float32).astype(kernel.dtype)
    return dh, dk


_lm_head_logits.defvjp(_lm_head_fwd, _lm_head_bwd)


def token_logprobs_from_hidden(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *,
                               chunk_size: int = LOGPROB_CHUNK, temperature: float = 1.0, with_entropy: bool = False):
    """log softmax(hidden @ lm_head / temperature)[targets], float32 [B, T].

    hidden [B, T, E] (any dtype), lm_head [E, V], targets int [B, T]. with_entropy: also return
    the entropy of each position's distribution, [B, T], computed in the same chunks.
    """
    b, t, e = hidden.shape
    chunk = min(chunk_size, t)
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden = hidden.reshape(b, n_chunks, chunk, e).swapaxes(0, 1)
    targets = targets.reshape(b, n_chunks, chunk).swapaxes(0, 1)
    kernel = lm_head.astype(hidden.dtype)

    @jax.checkpoint
    def one_chunk(args):
        h, tgt = args
        logits = _lm_head_logits(h, kernel) / temperature
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        lse = jax.nn.logsumexp(logits, axis=-1)
        if not with_entropy:
            return picked - lse
        entropy = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return picked - lse, entropy

    out = jax.lax.map(one_chunk, (hidden, targets))  # [n_chunks, B, chunk] (each)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :t]
    return tuple(map(unchunk, out)) if with_entropy else unchunk(out)


def token_logprobs(model, tokens: jax.Array, positions=None, segment_ids=None, *,
                   chunk_size: int = LOGPROB_CHUNK, temperature: float = 1.0, with_entropy: bool = False):
    """out[b, t] = log p(tokens[b, t] | tokens[b, :t]) for t >= 1; out[:, 0] = 0.

    Aligned with `tokens`, so a loss mask over token positions applies to it directly. With
    `with_entropy`, also the entropy of the distribution token t was drawn from (0 at t = 0):
    what the forking/reflection-token analysis reads, for rollouts of any engine.
    """
    hidden = model.hidden_states(tokens, positions, segment_ids)
    out = token_logprobs_from_hidden(hidden[:, :-1], model.lm_head_kernel(), tokens[:, 1:],
                                     chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy)
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return tuple(map(pad, out)) if with_entropy else pad(out)
