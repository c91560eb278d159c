"""Decoder behaviour: KV-cache decoding, packing, chunked log-probs, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from rstar2_jax import models
from tests.models.conftest import random_model, small_config


@nnx.jit
def forward(model, tokens, positions=None, segment_ids=None):
    return model(tokens, positions, segment_ids)


@nnx.jit(static_argnames=("chunk_size", "temperature"))
def logprobs(model, tokens, chunk_size, temperature):
    return models.token_logprobs(model, tokens, chunk_size=chunk_size, temperature=temperature)


def _tokens(b, t, vocab=257, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(1, vocab, size=(b, t)), jnp.int32)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_prefill_extend_decode_equals_full_forward(family):
    """Right-padded prefill, a multi-token extend at per-row offsets (a tool response), then
    token-by-token decode at per-row positions: every logit equals the full forward's."""
    model = random_model(small_config(family), seed=3)
    lengths = np.array([23, 15, 9])
    total = int(lengths.max())
    tokens = _tokens(3, total, seed=1)
    full = np.asarray(forward(model, tokens))

    step = nnx.jit(lambda m, tok, pos, cache: m(tok, pos, cache=cache))
    cache = models.init_cache(model.cfg, batch=3, max_len=32)
    prompt = np.array([6, 4, 2])  # per-row prompt lengths, right-padded to 6
    got = np.zeros_like(full)

    def run(cache, starts, width):
        pos = starts[:, None] + np.arange(width)[None, :]
        tok = np.take_along_axis(np.asarray(tokens), np.minimum(pos, total - 1), axis=1)
        logits, cache = step(model, jnp.asarray(tok), jnp.asarray(pos, jnp.int32), cache)
        for r in range(3):
            for j in range(width):
                if pos[r, j] < lengths[r]:
                    got[r, pos[r, j]] = np.asarray(logits[r, j])
        return cache

    cache = run(cache, np.zeros(3, np.int64), 6)          # prefill, right-padded
    starts = prompt.copy()
    cache = run(cache, starts, 5)                          # extend by 5 at rows' own offsets
    starts = starts + 5
    while (starts < lengths).any():                        # single-token decode
        cache = run(cache, starts, 1)
        starts = starts + 1
    for r in range(3):
        diff = np.abs(got[r, :lengths[r]] - full[r, :lengths[r]]).max()
        assert diff < 2e-5, f"row {r}: cached logits differ from full forward by {diff:.2e}"


def test_decode_compiles_once_for_all_steps(qwen3_model):
    traces = []

    @nnx.jit
    def decode(m, tok, pos, cache):
        traces.append(1)
        return m(tok, pos, cache=cache)

    cache = models.init_cache(qwen3_model.cfg, batch=2, max_len=16)
    for i in range(5):
        pos = jnp.array([[i], [i + 3]], jnp.int32)
        _, cache = decode(qwen3_model, _tokens(2, 1, seed=i), pos, cache)
    assert len(traces) == 1


@nnx.jit
def cached_forward(model, tokens, positions, cache):
    return model(tokens, positions, cache=cache)


def test_cache_write_past_end_is_dropped_not_clamped(qwen3_model):
    cache = models.init_cache(qwen3_model.cfg, batch=1, max_len=8)
    _, cache = cached_forward(qwen3_model, _tokens(1, 8), jnp.arange(8, dtype=jnp.int32)[None], cache)
    before = [np.asarray(k) for k in cache.keys]
    _, after = cached_forward(qwen3_model, _tokens(1, 1, seed=5), jnp.array([[8]], jnp.int32), cache)
    for b, a in zip(before, after.keys):
        np.testing.assert_array_equal(b, np.asarray(a))


def test_packed_segments_equal_separate_sequences(qwen3_model):
    a, b = _tokens(1, 7, seed=1), _tokens(1, 5, seed=2)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(7), jnp.arange(5)])[None].astype(jnp.int32)
    segments = jnp.array([[1] * 7 + [2] * 5], jnp.int32)
    out = np.asarray(forward(qwen3_model, packed, positions, segments))
    np.testing.assert_allclose(out[0, :7], np.asarray(forward(qwen3_model, a))[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 7:], np.asarray(forward(qwen3_model, b))[0], atol=1e-5)


_MODELS = {}


@settings(max_examples=6, deadline=None)
@given(t=st.integers(2, 40), chunk=st.integers(1, 48), temperature=st.sampled_from([1.0, 0.7]),
       tied=st.booleans())
@pytest.mark.slow
def test_chunked_logprobs_equal_log_softmax_of_full_logits(t, chunk, temperature, tied):
    if tied not in _MODELS:
        _MODELS[tied] = random_model(small_config("qwen3", tie_word_embeddings=tied), seed=int(tied))
    model = _MODELS[tied]
    tokens = _tokens(2, t, seed=t)
    got = np.asarray(logprobs(model, tokens, chunk, temperature))
    full = jax.nn.log_softmax(forward(model, tokens) / temperature, axis=-1)
    want = np.asarray(jnp.take_along_axis(full[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0])
    assert got.shape == (2, t)
    np.testing.assert_array_equal(got[:, 0], 0.0)
    np.testing.assert_allclose(got[:, 1:], want, atol=2e-5)


@pytest.mark.parametrize("chunk,expect_full", [(16, False), (64, True)])
def test_chunked_logprobs_never_materialise_full_logits(qwen3_model, chunk, expect_full):
    """The jaxpr of the chunked path holds no [B, T, vocab] array, forward or backward
    (and the check does see one when the chunk covers the whole sequence)."""
    tokens = _tokens(2, 64)
    graphdef, params = nnx.split(qwen3_model)

    def loss(params):
        m = nnx.merge(graphdef, params)
        return models.token_logprobs(m, tokens, chunk_size=chunk).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
    vocab = qwen3_model.cfg.vocab_size
    big = [s for s in _all_shapes(jaxpr.jaxpr) if len(s) >= 3 and s[-1] == vocab and int(np.prod(s[:-1])) > 2 * 16]
    assert bool(big) == expect_full, f"chunk={chunk}: full-logit-sized arrays: {big[:3]}"


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (remat, map, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def _all_shapes(jaxpr):
    return [getattr(v.aval, "shape", ()) for eqn in _all_eqns(jaxpr) for v in eqn.outvars]


def test_bf16_compute_close_to_fp32():
    cfg = small_config("qwen3")
    model32 = random_model(cfg, seed=4)
    model16 = models.Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    nnx.update(model16, nnx.state(model32, nnx.Param))
    tokens = _tokens(2, 48)
    a, b = np.asarray(forward(model32, tokens)), np.asarray(forward(model16, tokens).astype(jnp.float32))
    rel = np.abs(a - b).max() / np.abs(a).max()
    assert rel < 0.05, f"bf16 relative logit error {rel:.3f}"
    assert np.abs(a - b).max() > 0  # really ran in bf16


def test_chunked_entropy_equals_entropy_of_full_distribution(qwen3_model):
    tokens = _tokens(2, 21, seed=8)
    lp, ent = nnx.jit(lambda m, t: models.token_logprobs(m, t, chunk_size=8, temperature=0.8, with_entropy=True))(
        qwen3_model, tokens)
    logp = jax.nn.log_softmax(forward(qwen3_model, tokens) / 0.8, axis=-1)
    want = -jnp.sum(jnp.exp(logp) * logp, axis=-1)[:, :-1]
    np.testing.assert_allclose(np.asarray(ent)[:, 1:], np.asarray(want), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(ent)[:, 0], 0.0)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(logprobs(qwen3_model, tokens, 8, 0.8)), atol=1e-6)


def test_logprob_gradients_exact_in_fp32_and_close_in_bf16():
    """The LM head's custom backward (bf16 cotangent) is the exact gradient in float32 and
    within bf16 rounding of it in bfloat16."""
    from rstar2_jax.models import logprobs as lp_mod
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 40, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 50)) * 0.3, jnp.float32)
    tgt = jnp.asarray(rng.integers(0, 50, (2, 40)), jnp.int32)

    def plain(h, w):
        logits = jnp.einsum("bte,ev->btv", h, w)
        return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1))

    ours = lambda h, w: jnp.sum(lp_mod.token_logprobs_from_hidden(h, w, tgt, chunk_size=16))
    want = jax.grad(plain, argnums=(0, 1))(h, w)
    got = jax.grad(ours, argnums=(0, 1))(h, w)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-5)
    got16 = jax.grad(ours, argnums=(0, 1))(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    for g, ref in zip(got16, want):
        err = np.linalg.norm(np.asarray(g, np.float32) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
        assert err < 3e-2, err


def test_lm_head_matmuls_run_in_the_compute_dtype_forward_and_backward():
    """With bf16 compute every vocab-sized matmul of the log-prob gradient takes bf16 operands
    (a float32 cotangent would send the two backward ones to fp32/tf32 GEMMs)."""
    from rstar2_jax.models import logprobs as lp_mod
    vocab = 50
    h = jnp.zeros((2, 40, 16), jnp.bfloat16)
    w = jnp.zeros((16, vocab), jnp.bfloat16)
    tgt = jnp.zeros((2, 40), jnp.int32)
    loss = lambda h, w: jnp.sum(lp_mod.token_logprobs_from_hidden(h, w, tgt, chunk_size=16))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w)
    head_dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                 and any(vocab in getattr(v.aval, "shape", ()) for v in e.invars)]
    assert len(head_dots) >= 3  # forward (twice: remat), d/dh, d/dW
    assert all(v.aval.dtype == jnp.bfloat16 for e in head_dots for v in e.invars), \
        [[str(v.aval) for v in e.invars] for e in head_dots]
