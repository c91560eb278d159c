"""The sampler: greedy, temperature, top-k, top-p, and its log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2_jax.rollout.engines.sampling import SamplingParams, sample


def _logits(rows=4, vocab=50, seed=0):
    return jax.random.normal(jax.random.key(seed), (rows, vocab)) * 2


def test_greedy_rows_take_argmax_and_report_plain_logprob():
    logits = _logits()
    tok, logp = sample(logits, jax.random.key(1), jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.ones(4))
    np.testing.assert_array_equal(tok, jnp.argmax(logits, -1))
    np.testing.assert_allclose(logp, jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0], rtol=1e-6)


def test_logprob_is_under_the_untruncated_tempered_distribution():
    logits = _logits()
    t = jnp.array([0.5, 1.0, 1.5, 0.7])
    tok, logp = sample(logits, jax.random.key(2), t, jnp.array([5, 0, 3, 0]), jnp.array([1.0, 0.5, 1.0, 0.9]))
    want = jnp.take_along_axis(jax.nn.log_softmax(logits / t[:, None]), tok[:, None], -1)[:, 0]
    np.testing.assert_allclose(logp, want, rtol=1e-5)


def test_top_k_and_top_p_restrict_the_support():
    logits = jnp.tile(_logits(1, 30, seed=3), (2000, 1))
    order = np.argsort(-np.asarray(logits[0]))
    keys = jax.random.key(4)
    tok, _ = sample(logits, keys, jnp.ones(2000), jnp.full(2000, 3, jnp.int32), jnp.ones(2000))
    assert set(np.asarray(tok)) <= set(order[:3]) and len(set(np.asarray(tok))) == 3
    probs = np.asarray(jax.nn.softmax(logits[0]))
    nucleus = order[:int(np.searchsorted(np.cumsum(probs[order]), 0.6) + 1)]
    tok, _ = sample(logits, keys, jnp.ones(2000), jnp.zeros(2000, jnp.int32), jnp.full(2000, 0.6))
    assert set(np.asarray(tok)) == set(nucleus)
    tok, _ = sample(logits, keys, jnp.ones(2000), jnp.full(2000, 1, jnp.int32), jnp.ones(2000))
    assert set(np.asarray(tok)) == {order[0]}


def test_temperature_sampling_frequencies_follow_softmax():
    logits = jnp.tile(jnp.array([[0.0, 1.0, 2.0, -1.0]]), (20000, 1))
    tok, _ = sample(logits, jax.random.key(5), jnp.full(20000, 0.8), jnp.zeros(20000, jnp.int32), jnp.ones(20000))
    freq = np.bincount(np.asarray(tok), minlength=4) / 20000
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[0] / 0.8)), atol=0.015)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
