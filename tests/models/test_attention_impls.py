"""Every attention implementation computes the same function as the reference XLA path.

cuDNN itself needs an NVIDIA GPU (checked in experiments/benchmarks/gpu_checks.py); here the
same jax.nn call runs with its XLA implementation, which pins the layout, scale, GQA grouping
and causal mask we hand to it. The Pallas decode kernel runs interpreted on the CPU.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar2_jax import models
from rstar2_jax.models import attention, kv_cache
from tests.models.conftest import random_model, small_config


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("t", [1, 7, 64])
def test_fused_call_equals_reference_causal_attention(t):
    cfg = small_config("qwen3", num_heads=8, num_kv_heads=2)
    q, k, v = _rand((2, t, 8, 32), 0), _rand((2, t, 2, 32), 1), _rand((2, t, 2, 32), 2)
    causal = (np.arange(t)[None, :] <= np.arange(t)[:, None])[None]
    want = attention._xla_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), jnp.asarray(causal), cfg)
    got = attention._fused_causal_attention(q, k, v, cfg, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def _decode_logits(model, kv_len=None, steps=6, seed=0, page_size=None, return_cache=False):
    """Prefill ragged rows, then decode `steps` tokens; the logits of every decode step (with
    page_size: through a paged cache holding just the pages the rows need, scrambled)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([5, 130, 77, 1])  # rows far apart: a ragged batch
    if page_size is None:
        cache = models.init_cache(model.cfg, batch=4, max_len=256)
    else:
        cache = kv_cache.shuffled_paged_cache(model.cfg, lengths + steps, page_size, max_len=256)
    step = nnx.jit(lambda m, tok, pos, c: m(tok, pos, cache=c, kv_len=kv_len))
    prefill = nnx.jit(lambda m, tok, pos, c: m(tok, pos, cache=c))
    width = int(lengths.max())
    pos = np.where(np.arange(width)[None] < lengths[:, None], np.arange(width)[None], 256)  # pads dropped
    tokens = rng.integers(1, 257, size=(4, width))
    _, cache = prefill(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int32), cache)
    out = []
    for i in range(steps):
        tok = jnp.asarray(rng.integers(1, 257, size=(4, 1)), jnp.int32)
        logits, cache = step(model, tok, jnp.asarray((lengths + i)[:, None], jnp.int32), cache)
        out.append(np.asarray(logits[:, 0]))
    return (np.stack(out), cache) if return_cache else np.stack(out)


def test_decode_reading_a_live_prefix_equals_reading_the_whole_cache():
    model = random_model(small_config("qwen3"), seed=4)
    full = _decode_logits(model)
    prefix = _decode_logits(model, kv_len=136 + 1)  # longest row reaches slot 135 in 6 steps
    np.testing.assert_allclose(prefix, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [None, 1])
def test_pallas_ragged_decode_equals_xla_decode(splits):
    model = random_model(small_config("qwen3"), seed=5)
    want = _decode_logits(model, seed=1)
    got = _decode_logits(model.set_attention(decode="pallas", decode_splits=splits), seed=1)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_set_attention_rejects_unknown_implementations():
    model = random_model(small_config("qwen3"))
    with pytest.raises(ValueError, match="full attention"):
        model.set_attention(full="flash")
    with pytest.raises(ValueError, match="decode attention"):
        model.set_attention(decode="cudnn")
    assert model.set_attention(full="cudnn").layers[0].attn.full_impl == "cudnn"


def test_pallas_decode_is_really_taken_and_wants_128_slot_caches():
    model = random_model(small_config("qwen3")).set_attention(decode="pallas")
    cache = models.init_cache(model.cfg, batch=1, max_len=200)
    with pytest.raises(ValueError, match="multiple of 128"):
        model(jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache=cache)
    cache = models.init_cache(model.cfg, batch=1, max_len=384)
    with pytest.raises(ValueError, match="must divide the cache's 3 blocks"):
        model.set_attention(decode_splits=2)(jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache=cache)


def test_a_prefix_shorter_than_a_live_row_changes_its_logits():
    """kv_len is honoured (the law above would hold trivially if it were ignored)."""
    model = random_model(small_config("qwen3"), seed=4)
    np.testing.assert_raises(AssertionError, np.testing.assert_allclose,
                             _decode_logits(model, kv_len=64, steps=1), _decode_logits(model, steps=1), atol=1e-3)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_paged_cache_computes_what_contiguous_rows_compute(page_size):
    """Same positions, same values, read back through a shuffled page table: the logits are the
    rows' (the XLA path gathers the rows in position order, so they agree to the last bit)."""
    model = random_model(small_config("qwen3"), seed=4)
    np.testing.assert_array_equal(_decode_logits(model, page_size=page_size), _decode_logits(model))
    np.testing.assert_allclose(_decode_logits(model, page_size=page_size, kv_len=137), _decode_logits(model),
                               atol=1e-5, rtol=1e-5)


def test_pallas_paged_decode_equals_xla_decode():
    model = random_model(small_config("qwen3"), seed=5)
    want = _decode_logits(model, seed=1)
    got = _decode_logits(model.set_attention(decode="pallas"), seed=1, page_size=16)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_paged_writes_land_only_in_the_rows_pages():
    """Padding (positions past the table) and positions whose entry is "no page" are dropped:
    the pool's spare pages stay zero, every held page was written."""
    model = random_model(small_config("qwen3"), seed=4)
    _, cache = _decode_logits(model, page_size=16, return_cache=True)
    table = np.asarray(cache.page_table)
    held = set(table[table < cache.num_pages].tolist())
    for pool in cache.keys + cache.values:
        written = {p for p in range(cache.num_pages) if np.any(np.asarray(pool[:, p]) != 0)}
        assert written == held and len(held) == cache.num_pages - 5
