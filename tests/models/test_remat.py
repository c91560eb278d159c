"""Rematerialisation policies (models/decoder.py REMAT_POLICIES): each gives the gradients of no
remat, and "dots_attention" keeps cuDNN attention's forward outputs, so its backward pass does not
run the attention's forward a second time. The cuDNN kernel needs a GPU; its primitives trace
anywhere, so the count of forward kernels is read from the gradient's jaxpr on CPU (with JAX's
cuDNN version check answered, as on a GPU with cuDNN 9)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar2_jax.learner.packing import plan_packing
from rstar2_jax.models import decoder
from rstar2_jax.models.attention import PackedSegments
from rstar2_jax.models.decoder import Decoder
from rstar2_jax.models.tiny import tiny_config


def _packed_rows(lengths=(40, 30, 50), budget=128):
    plan = plan_packing(np.array(lengths), budget)
    layout = plan.layout()
    tokens = np.random.default_rng(0).integers(1, 300, (plan.rows, budget)) * (layout["segment_ids"] > 0)
    return (jnp.asarray(tokens, jnp.int32), jnp.asarray(layout["positions"]),
            PackedSegments(*(jnp.asarray(layout[k]) for k in ("segment_ids", "segment_starts", "segment_lengths"))))


def _count(jaxpr, name: str) -> int:
    """Equations of primitive `name` in `jaxpr` and every jaxpr inside its equations."""
    def inner(value):
        if isinstance(value, jax.extend.core.ClosedJaxpr):
            return [value.jaxpr]
        if isinstance(value, jax.extend.core.Jaxpr):
            return [value]
        if isinstance(value, (tuple, list)):
            return [j for v in value for j in inner(v)]
        return []
    return sum((eqn.primitive.name == name) + sum(_count(j, name) for v in eqn.params.values() for j in inner(v))
               for eqn in jaxpr.eqns)


def _loss(model, tokens, positions, segments):
    return model(tokens, positions, segments).astype(jnp.float32).mean()


def _grads(remat: str, dtype=jnp.float32, attention: str = "xla"):
    model = Decoder(tiny_config(num_layers=2), dtype=dtype, rngs=nnx.Rngs(0), remat=remat).set_attention(full=attention)
    return nnx.grad(_loss), model


@pytest.mark.parametrize("remat", ["full", "dots", "dots_attention"])
def test_every_policy_gives_the_gradients_of_no_remat(remat):
    tokens, positions, segments = _packed_rows()
    grad, model = _grads("none")
    want = nnx.state(grad(model, tokens, positions, segments), nnx.Param)
    grad, model = _grads(remat)
    got = nnx.state(grad(model, tokens, positions, segments), nnx.Param)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("remat, forwards_per_layer", [("none", 1), ("dots", 2), ("full", 2), ("dots_attention", 1)])
def test_dots_attention_does_not_run_cudnn_s_forward_again(monkeypatch, remat, forwards_per_layer):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)  # a Hopper GPU
    tokens, positions, segments = _packed_rows()
    _, model = _grads(remat, jnp.bfloat16, "cudnn")
    graphdef, params = nnx.split(model)
    grad = jax.grad(lambda params, *batch: _loss(nnx.merge(graphdef, params), *batch))
    jaxpr = jax.make_jaxpr(grad)(params, tokens, positions, segments).jaxpr
    layers = model.cfg.num_layers
    assert _count(jaxpr, decoder.CUDNN_ATTENTION_FORWARD) == forwards_per_layer * layers
    assert _count(jaxpr, "dot_product_attention_bwd_wrapper") == layers
