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


def token_logprobs_from_hidden(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *,
                               chunk_size: int = 512, temperature: float = 1.0, with_entropy: bool = False):
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
        logits = jnp.einsum("bce,ev->bcv", h, kernel, preferred_element_type=jnp.float32)
        logits = logits / temperature
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
                   chunk_size: int = 512, temperature: float = 1.0, with_entropy: bool = False):
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
