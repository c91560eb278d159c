"""Per-sequence sums on packed rows: several sequences share a row, told apart by segment id.

Packed rows (learner/packing.py) number each row's sequences 1, 2, ... in `segment_ids` [B, T]
(0 on padding). A loss, a correction or an aggregation that reduces over a sequence reduces over
a segment there: these are those reductions, row by row (a segment never spans rows, and rows
stay where a mesh put them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_totals(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Per row of x [B, T], the sum of each segment id's values [B, T + 1] (column k: segment k;
    column 0 sums the padding)."""
    t = x.shape[-1]
    return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=t + 1))(x, segment_ids)


def on_positions(totals: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Per-segment values [B, T + 1] placed on each segment's positions [B, T]."""
    return jnp.take_along_axis(totals, segment_ids, axis=-1)


def segment_sum(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each position's segment sum of x [B, T], on its positions."""
    return on_positions(segment_totals(x, segment_ids), segment_ids)


def segment_tokens(mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Each segment's masked positions [B, T + 1] (float32; padding's column 0 is 0)."""
    totals = segment_totals(mask.astype(jnp.float32), segment_ids)
    return totals.at[:, 0].set(0.0)
