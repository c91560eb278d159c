"""The decoder's small parts: parameters with their logical axes (`param`), RMSNorm and the MLP."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax.core import sharding
from rstar2_jax.models import lora
from rstar2_jax.models.config import ModelConfig


_INIT_STD = 0.02

def param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str) -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes))

class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype, axes=("norm",)):
        self.eps = eps
        self.scale = param(None, (dim,), axes, param_dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(dtype) * self.scale[...].astype(dtype)

class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, m = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.gate_proj = param(rngs, (e, m), ("embed", "mlp"), param_dtype, "normal")
        self.up_proj = param(rngs, (e, m), ("embed", "mlp"), param_dtype, "normal")
        self.down_proj = param(rngs, (m, e), ("mlp", "embed"), param_dtype, "normal")

    def __call__(self, x):
        gate = lora.adapted(self, "gate_proj", x, x @ self.gate_proj[...].astype(self.dtype))
        up = lora.adapted(self, "up_proj", x, x @ self.up_proj[...].astype(self.dtype))
        h = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "sequence", "mlp"))
        return lora.adapted(self, "down_proj", h, h @ self.down_proj[...].astype(self.dtype))
