"""Our parameter paths <-> Hugging Face tensor names, as data.

`kind` says how a tensor changes layout between the two:
- "same":   identical shape (norm scales, the embedding).
- "linear": HF stores torch Linear weights as [out, in]; we store [in..., out...] with heads
            split out, e.g. q_proj [hidden, heads, head_dim]. ours = W.T.reshape(ours);
            `in_ndim` says how many leading dims of ours are the input.
- "bias":   HF [heads * head_dim] <-> ours [heads, head_dim].
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.models.config import ModelConfig


class WeightSpec(NamedTuple):
    ours: str
    hf: str
    kind: str = "same"
    in_ndim: int = 1


GLOBAL_WEIGHTS = (
    WeightSpec("embed", "model.embed_tokens.weight"),
    WeightSpec("final_norm.scale", "model.norm.weight"),
    WeightSpec("lm_head", "lm_head.weight", "linear"),
)

LAYER_WEIGHTS = (
    WeightSpec("input_norm.scale", "input_layernorm.weight"),
    WeightSpec("post_attn_norm.scale", "post_attention_layernorm.weight"),
    WeightSpec("attn.q_proj", "self_attn.q_proj.weight", "linear"),
    WeightSpec("attn.k_proj", "self_attn.k_proj.weight", "linear"),
    WeightSpec("attn.v_proj", "self_attn.v_proj.weight", "linear"),
    WeightSpec("attn.o_proj", "self_attn.o_proj.weight", "linear", in_ndim=2),
    WeightSpec("attn.q_bias", "self_attn.q_proj.bias", "bias"),
    WeightSpec("attn.k_bias", "self_attn.k_proj.bias", "bias"),
    WeightSpec("attn.v_bias", "self_attn.v_proj.bias", "bias"),
    WeightSpec("attn.o_bias", "self_attn.o_proj.bias", "bias"),
    WeightSpec("attn.q_norm.scale", "self_attn.q_norm.weight"),
    WeightSpec("attn.k_norm.scale", "self_attn.k_norm.weight"),
    WeightSpec("mlp.gate_proj", "mlp.gate_proj.weight", "linear"),
    WeightSpec("mlp.up_proj", "mlp.up_proj.weight", "linear"),
    WeightSpec("mlp.down_proj", "mlp.down_proj.weight", "linear"),
)

# Tensors some checkpoints carry that are not parameters (recomputed from the config).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_specs(param_paths: list[str]) -> dict[str, WeightSpec]:
    """For each of the model's parameter paths (e.g. 'layers.3.attn.q_proj'), its WeightSpec
    with the HF name filled in. Every parameter must have a mapping."""
    by_ours = {w.ours: w for w in GLOBAL_WEIGHTS}
    by_layer = {w.ours: w for w in LAYER_WEIGHTS}
    out = {}
    for path in param_paths:
        if path in by_ours:
            out[path] = by_ours[path]
            continue
        parts = path.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[2] in by_layer:
            w = by_layer[parts[2]]
            out[path] = w._replace(ours=path, hf=f"model.layers.{parts[1]}.{w.hf}")
            continue
        raise KeyError(f"parameter {path!r} has no Hugging Face name in weight_map.py")
    return out


def hf_shape(spec: WeightSpec, our_shape: tuple[int, ...]) -> tuple[int, ...]:
    if spec.kind == "linear":
        return (int(np.prod(our_shape[spec.in_ndim:])), int(np.prod(our_shape[:spec.in_ndim])))
    if spec.kind == "bias":
        return (int(np.prod(our_shape)),)
    return tuple(our_shape)


def from_hf(spec: WeightSpec, tensor, our_shape: tuple[int, ...]):
    """HF layout -> ours. Pure layout: numpy arrays (a view where numpy can) or JAX arrays."""
    if spec.kind == "linear":
        return tensor.T.reshape(our_shape)
    return tensor.reshape(our_shape)


def to_hf(spec: WeightSpec, array):
    """Our layout -> HF's (the inverse of from_hf), numpy or JAX arrays."""
    shape = hf_shape(spec, array.shape)
    if spec.kind == "linear":
        return array.reshape(shape[::-1]).T
    return array.reshape(shape)


# The same layout changes, jitted on the device. Large host transposes run at well under 1 GB/s
# (numpy walks one of the two arrays across cache lines); an accelerator does them at memory
# speed, so export and single-device load move only contiguous bytes between host and device.
# Only the layout (names blanked) is static, so the layers of a model share compiled programs.
def from_hf_on_device(spec: WeightSpec, tensor: jax.Array, our_shape: tuple[int, ...], dtype) -> jax.Array:
    return _from_hf_jit(_layout(spec), tensor, tuple(our_shape), jnp.dtype(dtype))


def to_hf_on_device(spec: WeightSpec, array: jax.Array, dtype) -> jax.Array:
    return _to_hf_jit(_layout(spec), array, jnp.dtype(dtype))


def _layout(spec: WeightSpec) -> WeightSpec:
    return spec._replace(ours="", hf="")


@partial(jax.jit, static_argnums=(0, 2, 3))
def _from_hf_jit(layout: WeightSpec, tensor, our_shape, dtype):
    return from_hf(layout, tensor, our_shape).astype(dtype)


@partial(jax.jit, static_argnums=(0, 2))
def _to_hf_jit(layout: WeightSpec, array, dtype):
    return to_hf(layout, array).astype(dtype)


def unused_hf_name(name: str, cfg: ModelConfig) -> bool:
    """Names a checkpoint may carry that we deliberately do not load."""
    if name.endswith(IGNORED_HF_SUFFIXES):
        return True
    # Tied checkpoints sometimes also store lm_head.weight (a copy of the embedding).
    return cfg.tie_word_embeddings and name == "lm_head.weight"
