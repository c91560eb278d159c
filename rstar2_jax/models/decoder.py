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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar2_jax.core import sharding
from rstar2_jax.models import lora
from rstar2_jax.models.config import ModelConfig
from rstar2_jax.models.rope import apply_rope, inverse_frequencies, rope_angles

_INIT_STD = 0.02


FULL_ATTENTION = ("xla", "cudnn")
DECODE_ATTENTION = ("xla", "pallas")


class PackedSegments(NamedTuple):
    """Packed rows (learner/packing.py), passed as `segment_ids`: `ids` [B, T] (1, 2, ... within a
    row, 0 on padding) masks XLA attention; `starts` [B, M + 1] and `lengths` [B, M] (int32, -1
    past a row's last segment; M a static bound) are what cuDNN's packed attention reads."""
    ids: jax.Array
    starts: jax.Array
    lengths: jax.Array


class KVCache(NamedTuple):
    """Per-layer key/value buffers, each [batch, kv_heads, max_len, head_dim]. Slot s holds position s.

    Head-major, so one row's keys of one head are contiguous: a prefix [:, :, :n] is a plain
    strided read and the ragged decode kernel streams each head's live slots without a transpose.
    """
    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(keys=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   values=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


class PagedKVCache(NamedTuple):
    """Per-layer page pools, each [kv_heads, num_pages, page_size, head_dim] (the layout of the
    Pallas paged-attention kernel), and the rows' page tables [batch, pages_per_row] int32.

    Position p of row b lives at slot p % page_size of page page_table[b, p // page_size]. An
    entry equal to num_pages means "no page": writes there are dropped and reads are masked, so
    padding and idle rows never touch a page another row owns. The page table belongs to the
    call (the engine builds it from its allocator each step); `page_table=None` stores the pools.
    """
    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    page_table: jax.Array | None

    @property
    def num_pages(self) -> int:
        return self.keys[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.keys[0].shape[2]


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> PagedKVCache:
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return PagedKVCache(keys=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                        values=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)), page_table=None)


def shuffled_paged_cache(cfg: ModelConfig, lengths, page_size: int, max_len: int, spare: int = 5, seed: int = 0,
                         dtype=jnp.float32) -> PagedKVCache:
    """A paged cache whose rows hold just the pages their `lengths` need, drawn in a shuffled
    order from a pool with `spare` pages nobody holds (the rest of each table: "no page"): what an
    engine's pool looks like after many allocations, for checks of the paged decode paths."""
    per_row = [-(-int(n) // page_size) for n in lengths]
    num_pages = sum(per_row) + spare
    order = np.random.default_rng(seed).permutation(num_pages)
    table = np.full((len(per_row), max_len // page_size), num_pages, np.int32)
    start = 0
    for row, n in enumerate(per_row):
        table[row, :n] = order[start:start + n]
        start += n
    return init_paged_cache(cfg, num_pages, page_size, dtype)._replace(page_table=jnp.asarray(table))


def _write_pages(pool_k, pool_v, page_table, positions, k, v):
    """Write k/v [B, T, kv_heads, d] at `positions` [B, T] through the page table."""
    num_pages, page_size = pool_k.shape[1], pool_k.shape[2]
    # a position past the table (idle rows sit at max_len) or on an unallocated entry maps to
    # page num_pages, which mode="drop" discards
    pages = jnp.take_along_axis(page_table, positions // page_size, axis=1, mode="fill", fill_value=num_pages)
    offsets = positions % page_size
    # [:, pages, offsets] with [B, T] indices addresses [kv_heads, B, T, d]
    pool_k = pool_k.at[:, pages, offsets].set(k.transpose(2, 0, 1, 3).astype(pool_k.dtype), mode="drop")
    pool_v = pool_v.at[:, pages, offsets].set(v.transpose(2, 0, 1, 3).astype(pool_v.dtype), mode="drop")
    return pool_k, pool_v


def _gather_pages(pool, page_table, kv_len):
    """A row view [B, kv_heads, n, d] of the first n = kv_len (rounded up to pages; None: all)
    positions of every row. Unallocated entries read page num_pages - 1: masked by position."""
    num_pages, page_size = pool.shape[1], pool.shape[2]
    n_pages = page_table.shape[1] if kv_len is None else min(page_table.shape[1], -(-kv_len // page_size))
    table = jnp.minimum(page_table[:, :n_pages], num_pages - 1)
    rows = pool[:, table]  # [kv_heads, B, n_pages, page_size, d]
    kv, b = rows.shape[:2]
    return rows.transpose(1, 0, 2, 3, 4).reshape(b, kv, n_pages * page_size, pool.shape[3])


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str) -> nnx.Param:
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
        self.scale = _param(None, (dim,), axes, param_dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(dtype) * self.scale[...].astype(dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg, self.dtype = cfg, dtype
        self.full_impl, self.decode_impl = "xla", "xla"  # see Decoder.set_attention
        self.decode_splits: int | None = None
        self.decode_mesh = None  # Pallas decode under tensor parallelism: the engine's mesh (set_attention)
        self.q_proj = _param(rngs, (e, h, d), ("embed", "q_heads", "head_dim"), param_dtype, "normal")
        self.k_proj = _param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal")
        self.v_proj = _param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal")
        self.o_proj = _param(rngs, (h, d, e), ("q_heads", "head_dim", "embed"), param_dtype, "normal")
        if cfg.attention_bias:
            self.q_bias = _param(None, (h, d), ("q_heads", "head_dim"), param_dtype, "zeros")
            self.k_bias = _param(None, (kv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
            self.v_bias = _param(None, (kv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
            if cfg.family == "llama":  # Llama's attention_bias also puts a bias on o_proj
                self.o_bias = _param(None, (e,), ("embed",), param_dtype, "zeros")
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
            pool_k, pool_v = _write_pages(pool_k, pool_v, page_table, positions, k, v)
            new_cache = (pool_k, pool_v, page_table)
            if self.decode_impl == "pallas" and t == 1:
                out = _by_kv_heads(self.decode_mesh, _pallas_paged_decode_attention, cfg, (2, 0, 0, None, None))(
                    q, pool_k.astype(self.dtype), pool_v.astype(self.dtype), page_table, positions[:, 0] + 1)
            else:
                keys = _gather_pages(pool_k, page_table, kv_len).astype(self.dtype)
                values = _gather_pages(pool_v, page_table, kv_len).astype(self.dtype)
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


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, m = cfg.hidden_size, cfg.intermediate_size
        self.dtype = dtype
        self.gate_proj = _param(rngs, (e, m), ("embed", "mlp"), param_dtype, "normal")
        self.up_proj = _param(rngs, (e, m), ("embed", "mlp"), param_dtype, "normal")
        self.down_proj = _param(rngs, (m, e), ("mlp", "embed"), param_dtype, "normal")

    def __call__(self, x):
        gate = lora.adapted(self, "gate_proj", x, x @ self.gate_proj[...].astype(self.dtype))
        up = lora.adapted(self, "up_proj", x, x @ self.up_proj[...].astype(self.dtype))
        h = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "sequence", "mlp"))
        return lora.adapted(self, "down_proj", h, h @ self.down_proj[...].astype(self.dtype))


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
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype, "normal")
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype, "normal")

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
