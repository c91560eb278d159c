"""The FLOP model agrees with XLA's own count of the compiled forward, and the parameter count
with the parameters a Decoder really holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar2_jax.models import Decoder, flops
from tests.models.conftest import small_config


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("qwen3", True), ("qwen2", False)])
def test_param_count_equals_the_decoders_parameters(family, tied):
    cfg = small_config(family, tie_word_embeddings=tied)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    held = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert flops.param_count(cfg) == held


@pytest.mark.parametrize("seq", [32, 128])
def test_forward_flops_match_xlas_cost_analysis(seq):
    """XLA executes the full (masked) score matrix, so it is compared with causal=False; its
    count also includes elementwise work, which our convention leaves out: a few percent."""
    cfg = small_config("qwen3", hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2, head_dim=32,
                       num_layers=2, vocab_size=512)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    cost = fwd.lower(state, jnp.zeros((2, seq), jnp.int32)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ours = flops.forward_flops(cfg, seq, rows=2, causal=False)
    assert 0.9 < cost["flops"] / ours < 1.15, (cost["flops"], ours)
    assert flops.forward_flops(cfg, seq, 2) < ours  # causal counts fewer keys


def test_train_step_is_three_forwards_and_decode_bytes_grow_with_live_kv():
    cfg = small_config("qwen3")
    assert flops.train_step_flops(cfg, 64, 3) == 3 * flops.forward_flops(cfg, 64, 3)
    short, long = flops.decode_step_bytes(cfg, [10, 10]), flops.decode_step_bytes(cfg, [10, 30])
    assert long - short == 20 * flops.kv_bytes_per_token(cfg)
