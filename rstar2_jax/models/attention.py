"""Attention: the projections with RoPE and the cache write, and the implementations that compute
it (Decoder.set_attention; models/decoder.py's docstring lists them): XLA, cuDNN (plain and
packed rows) and the Pallas decode kernels (contiguous and paged)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rstar2_jax.core import sharding
from rstar2_jax.models import lora
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.rope import apply_rope
from rstar2_jax.models.kv_cache import gather_pages, write_pages
from rstar2_jax.models.layers import RMSNorm, param


FULL_ATTENTION = ("xla", "cudnn")

DECODE_ATTENTION = ("xla", "pallas")

class PackedSegments(NamedTuple):
    """Packed rows (learner/packing.py), passed as `segment_ids`: `ids` [B, T] (1, 2, ... within a
    row, 0 on padding) masks XLA attention; `starts` [B, M + 1] and `lengths` [B, M] (int32, -1
    past a row's last segment; M a static bound) are what cuDNN's packed attention reads."""
    ids: jax.Array
    starts: jax.Array
    lengths: jax.Array

class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.dtype = cfg, dtype
        self.full_impl, self.decode_impl = "xla", "xla"  # see Decoder.set_attention
        self.decode_splits: int | None = None
        self.decode_mesh = None  # Pallas decode under tensor parallelism: the engine's mesh (set_attention)
        self.q_proj = param(rngs, (e, h, d), ("embed", "q_heads", "head_dim"), param_dtype, "normal")
        self.k_proj = param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal")
        self.v_proj = param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal")
        self.o_proj = param(rngs, (h, d, e), ("q_heads", "head_dim", "embed"), param_dtype, "normal")
        if cfg.attention_bias:
            self.q_bias = param(None, (h, d), ("q_heads", "head_dim"), param_dtype, "zeros")
            self.k_bias = param(None, (kv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
            self.v_bias = param(None, (kv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
            if cfg.family == "llama":  # Llama's attention_bias also puts a bias on o_proj
                self.o_bias = param(None, (e,), ("embed",), param_dtype, "zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype, axes=("head_dim",))
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype, axes=("head_dim",))

    def _project(self, x, name, bias_name):
        out = jnp.einsum("bte,ehd->bthd", x, getattr(self, name)[...].astype(self.dtype))
        out = lora.adapted(self, name, x, out)
        if self.cfg.attention_bias:
            out = out + getattr(self, bias_name)[...].astype(self.dtype)
        return out

    def __call__(self, x, sin, cos, positions, segment_ids, layer_cache, kv_len=None):
        cfg = self.cfg
        q = self._project(x, "q_proj", "q_bias")
        k = self._project(x, "k_proj", "k_bias")
        v = self._project(x, "v_proj", "v_bias")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
        q = sharding.constrain(q, ("batch", "sequence", "q_heads", "head_dim"))
        k = sharding.constrain(k, ("batch", "sequence", "kv_heads", "head_dim"))

        b, t = x.shape[:2]
        new_cache = None
        if layer_cache is None:
            if self.full_impl == "cudnn" and segment_ids is None:
                out = _fused_causal_attention(q, k, v, cfg, implementation="cudnn")
            elif self.full_impl == "cudnn" and isinstance(segment_ids, PackedSegments):
                out = _cudnn_packed_attention(q, k, v, segment_ids, cfg)
            else:
                ids = segment_ids.ids if isinstance(segment_ids, PackedSegments) else segment_ids
                idx = jnp.arange(t)
                mask = (idx[None, :] <= idx[:, None])[None]  # [1, T, S] causal by index
                if ids is not None:
                    mask = mask & (ids[:, :, None] == ids[:, None, :])
                out = _xla_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, cfg)
        elif len(layer_cache) == 3:  # paged: (pool_k, pool_v, page_table)
            pool_k, pool_v, page_table = layer_cache
            pool_k, pool_v = write_pages(pool_k, pool_v, page_table, positions, k, v)
            new_cache = (pool_k, pool_v, page_table)
            if self.decode_impl == "pallas" and t == 1:
                out = _by_kv_heads(self.decode_mesh, _pallas_paged_decode_attention, cfg, (2, 0, 0, None, None))(
                    q, pool_k.astype(self.dtype), pool_v.astype(self.dtype), page_table, positions[:, 0] + 1)
            else:
                keys = gather_pages(pool_k, page_table, kv_len).astype(self.dtype)
                values = gather_pages(pool_v, page_table, kv_len).astype(self.dtype)
                mask = jnp.arange(keys.shape[2])[None, None, :] <= positions[:, :, None]  # [B, T, S]
                out = _xla_attention(q, keys, values, mask, cfg)
        else:
            cache_k, cache_v = layer_cache
            rows = jnp.arange(b)[:, None]
            # [B, T] advanced indices around the head slice: the update is [B, T, kv_heads, d].
            # mode="drop": a padded position past the end of the cache is discarded, never clamped
            # onto a real slot.
            cache_k = cache_k.at[rows, :, positions].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[rows, :, positions].set(v.astype(cache_v.dtype), mode="drop")
            new_cache = (cache_k, cache_v)
            n = cache_k.shape[2] if kv_len is None else min(kv_len, cache_k.shape[2])
            keys, values = cache_k[:, :, :n].astype(self.dtype), cache_v[:, :, :n].astype(self.dtype)
            if self.decode_impl == "pallas" and t == 1:
                out = _by_kv_heads(self.decode_mesh, _pallas_decode_attention, cfg, (2, 1, 1, None), self.decode_splits)(
                    q, keys, values, positions[:, 0] + 1)
            else:
                mask = jnp.arange(n)[None, None, :] <= positions[:, :, None]  # [B, T, S]
                out = _xla_attention(q, keys, values, mask, cfg)

        out = lora.adapted(self, "o_proj", out, jnp.einsum("bthd,hde->bte", out, self.o_proj[...].astype(self.dtype)))
        if cfg.attention_bias and cfg.family == "llama":
            out = out + self.o_bias[...].astype(self.dtype)
        return out, new_cache

def _xla_attention(q, keys, values, mask, cfg: ModelConfig):
    """q [B, T, H, d]; keys/values [B, kv_heads, S, d]; mask bool [B or 1, T, S] -> [B, T, H, d]."""
    b, t = q.shape[:2]
    groups = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, keys, preferred_element_type=jnp.float32)
    scores = scores * (cfg.head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", probs, values).reshape(b, t, cfg.num_heads, cfg.head_dim)

def _fused_causal_attention(q, k, v, cfg: ModelConfig, implementation: str):
    """Causal attention through jax.nn.dot_product_attention: q [B, T, H, d], k/v [B, T, kv_heads, d].

    With implementation="cudnn" this is cuDNN's fused flash attention (bf16/fp16 on NVIDIA GPUs:
    no [T, T] scores in memory, forward or backward); "xla" is the same call on any backend.
    """
    return jax.nn.dot_product_attention(q, k, v, scale=cfg.head_dim ** -0.5, is_causal=True,
                                        implementation=implementation)

def _cudnn_packed_attention(q, k, v, segments: PackedSegments, cfg: ModelConfig):
    """Causal attention within each segment of packed rows, by cuDNN's packed (ragged) flash
    attention: no [T, T] scores and no work across segments. The layout is not in
    jax.nn.dot_product_attention yet (JAX 0.10-0.11), hence JAX's own cuDNN module. Positions in
    no segment (padding, id 0) have no attention statistics: the kernel's gradients there were
    NaN on an H200 and reached every weight through 0 x NaN. So q, k, v and the output pass
    through a `where` on the ids, whose gradient selects 0 there, whatever the kernel computed."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # GPU only: imported where used
    real = (segments.ids > 0)[:, :, None, None]
    q, k, v = (jnp.where(real, x, 0) for x in (q, k, v))
    out = cudnn.dot_product_attention(q, k, v, q_seqlen=segments.lengths, kv_seqlen=segments.lengths,
                                      q_offsets=segments.starts, kv_offsets=segments.starts,
                                      scale=cfg.head_dim ** -0.5, mask_type=cudnn.MaskType.CAUSAL, qkv_layout="BTNH")
    return jnp.where(real, out, 0).astype(q.dtype)

def _by_kv_heads(mesh, kernel, cfg: ModelConfig, head_axes: tuple, *extra):
    """`kernel(*args, cfg, *extra)` on each device's heads under tensor parallelism: shard_map over
    the mesh's tensor axis, each argument split on its heads axis (`head_axes`, None: whole), the
    output on the query heads'. A group's query heads stay with their KV head when the KV heads
    divide evenly (GQA). Without a mesh (or one device on the tensor axis): the kernel as is."""
    tp = 1 if mesh is None else mesh.shape.get("tensor", 1)
    if tp == 1:
        return lambda *args: kernel(*args, cfg, *extra)
    if cfg.num_kv_heads % tp:
        raise ValueError(f"pallas decode attention under tensor parallelism needs the KV heads ({cfg.num_kv_heads}) "
                         f"to divide over the tensor axis ({tp})")
    from jax.sharding import PartitionSpec as P

    def spec(axis, ndim):
        return P() if axis is None else P(*[("tensor" if i == axis else None) for i in range(ndim)])

    def run(*args):
        in_specs = tuple(spec(a, x.ndim) for a, x in zip(head_axes, args))
        return jax.shard_map(lambda *a: kernel(*a, cfg, *extra), mesh=mesh, in_specs=in_specs,
                             out_specs=spec(2, 4), check_vma=False)(*args)
    return run

def _pallas_decode_attention(q, keys, values, lengths, cfg: ModelConfig, splits: int | None = None):
    """One query token per row against its first lengths[b] cache slots: the ragged read.

    Blocks of 128 slots past a row's length are skipped, so a row costs what it has written, not
    the cache's capacity. Each (row, kv head) is cut into `splits` chunks run in parallel and
    combined (flash-decoding); None: up to 16 (a divisor of the cache's 128-slot blocks).
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    s = keys.shape[2]
    if s % 128:
        raise ValueError(f"pallas decode attention needs a cache length that is a multiple of 128, got {s}")
    blocks = s // 128
    if splits is None:
        splits = max(d for d in range(1, 17) if blocks % d == 0)
    elif splits < 1 or blocks % splits:
        raise ValueError(f"decode_splits={splits} must divide the cache's {blocks} blocks of 128 slots")
    # gqa wants [B, S, kv_heads, d] and swaps to head-major itself; the two swaps cancel in XLA.
    out = decode_attention.gqa(q[:, 0], keys.swapaxes(1, 2), values.swapaxes(1, 2), kv_seq_len=lengths,
                               sm_scale=cfg.head_dim ** -0.5, block_k=128, k_splits=splits,
                               interpret=jax.default_backend() == "cpu")
    return out[:, None].astype(q.dtype)

def _pallas_paged_decode_attention(q, pool_k, pool_v, page_table, lengths, cfg: ModelConfig):
    """One query token per row against its first lengths[b] positions, read page by page
    through the page table (no row view is gathered)."""
    from jax.experimental.pallas.ops.gpu import paged_attention

    num_pages, page_size = pool_k.shape[1], pool_k.shape[2]
    pages_per_row = page_table.shape[1]
    splits = max(d for d in range(1, 17) if pages_per_row % d == 0)
    per_block = max(d for d in range(1, 9) if (pages_per_row // splits) % d == 0)
    # idle rows ask for max_len + 1 positions: clamp to the table; their output is discarded
    lengths = jnp.minimum(lengths, pages_per_row * page_size).astype(jnp.int32)
    # the kernel applies no softmax scale: fold it into q (in float32, then back)
    q = (q[:, 0].astype(jnp.float32) * cfg.head_dim ** -0.5).astype(q.dtype)
    out = paged_attention.paged_attention(q, pool_k, pool_v, jnp.minimum(page_table, num_pages - 1), lengths,
                                          k_splits=splits, pages_per_compute_block=per_block,
                                          interpret=jax.default_backend() == "cpu")
    return out[:, None].astype(q.dtype)
