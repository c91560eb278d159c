import jax.numpy as jnp
import pytest
from flax import nnx

from rstar2_jax.models import Decoder, ModelConfig


def small_config(family="qwen3", **overrides) -> ModelConfig:
    base = dict(family=family, vocab_size=257, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=family == "qwen3",
                attention_bias=family == "qwen2")
    base.update(overrides)
    return ModelConfig(**base)


def random_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, param_dtype=jnp.float32) -> Decoder:
    """A decoder whose norms and biases are random too (not 1 and 0), so none is a no-op."""
    model = Decoder(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed))
    rngs = nnx.Rngs(seed + 1)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = path[-2] if path[-1] == "scale" else path[-1]
        if path[-1] == "scale" or "bias" in str(name):
            noise = 0.2 * jnp.asarray(jax_normal(rngs, var.get_value().shape))
            base = 1.0 if path[-1] == "scale" else 0.0
            var.set_value((base + noise).astype(var.get_value().dtype))
    return model


def jax_normal(rngs, shape):
    import jax
    return jax.random.normal(rngs.params(), shape)


@pytest.fixture
def qwen3_model():
    return random_model(small_config("qwen3"))
