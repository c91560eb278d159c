"""One Flax NNX decoder for Qwen3, Qwen2/2.5 and Llama 3.

Parameters are stored in float32 or bfloat16 (`param_dtype`) and cast to the compute dtype
(`dtype`) at use, so fp32 master weights with bf16 compute is one constructor argument.
Softmax, RMSNorm statistics and RoPE angles are always float32.

Every parameter carries its logical axes (`axes` metadata, see `rstar2_jax.core.sharding`).

Three ways to run it:
- `model(tokens, positions=None, segment_ids=None)` -> logits [B, T, vocab]: full forward.
  Causal by index; with `segment_ids` (packing) a token only sees its own segment. Right
  padding needs no mask: real tokens never look right.
- `model(tokens, positions, cache=cache)` -> (logits, cache): writes K/V at cache slot
  `positions[b, t]` and attends to slots <= that position. Prefill (positions 0..T-1),
  single-token decode (T = 1, per-row positions) and extending a row after a tool response
  are all this one call, with static shapes. `kv_len` (static) reads only the first kv_len
  slots of the cache: the engine passes the smallest bucket that covers every live row.
  The cache is a `KVCache` (one contiguous [batch, max_len] row per sequence) or a
  `PagedKVCache` (a pool of fixed-size pages and a page table per row: memory follows the
  tokens written, not batch x max_len); the call is the same.
- `model.hidden_states(...)` + `models.logprobs` for log-probs without the full logits.

The parts: models/kv_cache.py (the caches), models/attention.py (attention and its
implementations), models/layers.py (parameters, RMSNorm, MLP); this module is the layer stack,
its rematerialisation policies and the Decoder.

Attention implementations (`Decoder.set_attention`), all computing the same function:
- full forward (training, log-probs): "xla" (einsum + masked fp32 softmax, any backend, packing)
  or "cudnn" (fused flash attention on NVIDIA GPUs: `jax.nn.dot_product_attention` for plain
  rows; packed rows given as `PackedSegments` take cuDNN's packed (ragged) layout, Hopper or
  newer, each segment its own causal sequence; packed rows given as bare segment ids take "xla").
- single-token decode against the cache: "xla" (reads the whole cache, or the kv_len prefix; a
  paged cache is first gathered into rows) or "pallas" (ragged Pallas kernels, contiguous or
  paged: each row reads only its live slots; GPU, or interpreted on CPU for tests).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax.core import sharding
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.rope import inverse_frequencies, rope_angles
from rstar2_jax.models.attention import DECODE_ATTENTION, FULL_ATTENTION, Attention
from rstar2_jax.models.kv_cache import KVCache, PagedKVCache
from rstar2_jax.models.layers import MLP, RMSNorm, param


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, sin, cos, positions, segment_ids, layer_cache, kv_len=None):
        attn_out, layer_cache = self.attn(self.input_norm(x), sin, cos, positions, segment_ids, layer_cache, kv_len)
        x = x + attn_out
        x = x + self.mlp(self.post_attn_norm(x))
        return sharding.constrain(x, ("batch", "sequence", "embed")), layer_cache

def _call_layer(layer, *args):
    return layer(*args)

# The primitive JAX's cuDNN attention binds in its forward rule (jax/_src/cudnn/
# fused_attention_stablehlo.py, JAX 0.10-0.11); its outputs are the attention's output and softmax
# statistics, what the backward kernel reads. Matched by name, as axlearn's flash-attention remat
# policy does: the call is inside JAX, out of reach of checkpoint_name.
CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"

def dots_and_attention_saveable(prim, *avals, **params) -> bool:
    """Matmul outputs (as "dots") and cuDNN attention's forward outputs: the backward pass runs
    cuDNN's backward kernel on them instead of running the attention's forward again. With XLA
    attention (no such primitive) this is "dots"."""
    return (str(prim) == CUDNN_ATTENTION_FORWARD
            or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params))

# Rematerialisation of each decoder layer in the backward pass (set Decoder.remat):
# "none" keeps all activations, "full" keeps only layer inputs, "dots" keeps matmul outputs,
# "dots_attention" those and cuDNN attention's output and statistics (memory_plan counts each).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_attention": dots_and_attention_saveable,
}

def _remat_layer(name: str):
    if name == "none":
        return _call_layer
    return nnx.remat(_call_layer, policy=REMAT_POLICIES[name])

class Decoder(nnx.Module):
    """Causal LM: embed -> N x (pre-norm attention + SwiGLU MLP) -> norm -> lm head."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs, remat: str = "none"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        self.cfg, self.dtype = cfg, dtype
        self.remat = remat  # training only: recompute layer activations in the backward pass
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype, "normal")
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype, "normal")

    def lm_head_kernel(self) -> jax.Array:
        """[hidden, vocab] output projection (the embedding, transposed, when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    @property
    def decode_attention(self) -> str:
        """The single-token attention every layer uses ("xla" | "pallas"; set_attention)."""
        return self.layers[0].attn.decode_impl

    def set_attention(self, full: str | None = None, decode: str | None = None,
                      decode_splits: int | None = None, decode_mesh=None) -> "Decoder":
        """Choose the attention implementation of every layer (see the module docstring).

        full: "xla" | "cudnn" for forwards without a cache; decode: "xla" | "pallas" for
        single-token steps against the cache; decode_splits: the Pallas kernel's parallel chunks
        per row and head (None: its default); decode_mesh: the engine's mesh, over whose tensor
        axis the Pallas kernels run by heads (shard_map). Set it before nnx.split (engines, learners).
        """
        if full is not None and full not in FULL_ATTENTION:
            raise ValueError(f"full attention must be one of {FULL_ATTENTION}, got {full!r}")
        if decode is not None and decode not in DECODE_ATTENTION:
            raise ValueError(f"decode attention must be one of {DECODE_ATTENTION}, got {decode!r}")
        for layer in self.layers:
            layer.attn.full_impl = full or layer.attn.full_impl
            layer.attn.decode_impl = decode or layer.attn.decode_impl
            layer.attn.decode_splits = decode_splits or layer.attn.decode_splits
            layer.attn.decode_mesh = decode_mesh or layer.attn.decode_mesh
        return self

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, cache: KVCache | PagedKVCache | None = None,
                      kv_len: int | None = None):
        """Final-normed hidden states [B, T, hidden] (and the updated cache when given one)."""
        b, t = tokens.shape
        if positions is None:
            if cache is not None:
                raise ValueError("a cached forward needs explicit positions (the cache slots to write)")
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        x = sharding.constrain(x, ("batch", "sequence", "embed"))
        sin, cos = rope_angles(positions, inverse_frequencies(self.cfg.rope, self.cfg.head_dim))
        new_keys, new_values = [], []
        run_layer = _remat_layer(self.remat)
        for i, layer in enumerate(self.layers):
            if cache is None:  # training / log-probs: remat applies here only
                x, _ = run_layer(layer, x, sin, cos, positions, segment_ids, None)
            else:
                paged = isinstance(cache, PagedKVCache)
                layer_cache = (cache.keys[i], cache.values[i]) + ((cache.page_table,) if paged else ())
                x, (k, v, *_) = layer(x, sin, cos, positions, segment_ids, layer_cache, kv_len)
                new_keys.append(k)
                new_values.append(v)
        h = self.final_norm(x)
        if cache is None:
            return h
        return h, cache._replace(keys=tuple(new_keys), values=tuple(new_values))

    def logits(self, hidden: jax.Array) -> jax.Array:
        out = jnp.einsum("bte,ev->btv", hidden, self.lm_head_kernel().astype(self.dtype))
        return sharding.constrain(out, ("batch", "sequence", "vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None, cache: KVCache | PagedKVCache | None = None,
                 kv_len: int | None = None):
        if cache is None:
            return self.logits(self.hidden_states(tokens, positions, segment_ids))
        h, cache = self.hidden_states(tokens, positions, segment_ids, cache, kv_len)
        return self.logits(h), cache
