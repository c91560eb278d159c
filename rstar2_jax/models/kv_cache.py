"""The decoder's KV caches: `KVCache` (one contiguous [batch, max_len] row per sequence) and
`PagedKVCache` (a pool of fixed-size pages and a page table per row: memory follows the tokens
written, not batch x max_len), and the paged write and gather the attention uses."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.models.config import ModelConfig


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

def write_pages(pool_k, pool_v, page_table, positions, k, v):
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

def gather_pages(pool, page_table, kv_len):
    """A row view [B, kv_heads, n, d] of the first n = kv_len (rounded up to pages; None: all)
    positions of every row. Unallocated entries read page num_pages - 1: masked by position."""
    num_pages, page_size = pool.shape[1], pool.shape[2]
    n_pages = page_table.shape[1] if kv_len is None else min(page_table.shape[1], -(-kv_len // page_size))
    table = jnp.minimum(page_table[:, :n_pages], num_pages - 1)
    rows = pool[:, table]  # [kv_heads, B, n_pages, page_size, d]
    kv, b = rows.shape[:2]
    return rows.transpose(1, 0, 2, 3, 4).reshape(b, kv, n_pages * page_size, pool.shape[3])
