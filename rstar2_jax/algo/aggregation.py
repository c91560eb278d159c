"""How per-token losses become one number: registered aggregations, exact under micro-batching.

An aggregation is two pure functions of the loss mask (through each sequence's token count):

    row_scale(mask) [B]       what each sequence's token sum is multiplied by
    count(mask, C)  scalar    the normaliser of the whole (mini-)batch; never depends on the weights,
                              and is a sum over sequences (micro-batches' counts add up to it)

    loss = sum_i row_scale_i sum_t m_it l_it / count(whole batch)

The update computes `count` once on the whole mini-batch and divides every micro-batch's
scaled sum by it, so M micro-batches give exactly the one-batch loss for every mode.

    token_mean            sum l / sum m                        (DAPO, rStar2-Agent; verl "token-mean")
    seq_mean_token_mean   mean over sequences of token means   (GRPO as published; verl "seq-mean-token-mean")
    seq_mean_token_sum    mean over sequences of token sums    (verl "seq-mean-token-sum")
    constant              sum l / (sequences x C)              (Dr. GRPO, arXiv 2503.20783: 1/G over
                                                                the group, each sequence's token sum
                                                                over a constant C, no 1/|o_i|)

The verl names are `agg_loss`'s modes in verl/trainer/ppo/core_algos.py at volcengine/verl
b178a3c (2026-01-29), one process. `constant` differs from verl's "seq-mean-token-sum-norm" on
purpose: verl divides the whole batch's token sum by C alone (sum l / C), which grows with the
number of sequences in a batch; we keep Dr. GRPO's 1/G, so the loss's scale does not depend on the
batch size (tests/algo/test_losses.py checks ours = verl's / sequences).

Sequences with no model token (padding rows) count in no mode (verl excludes them as well).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from rstar2_jax.algo.segments import on_positions, segment_tokens
from rstar2_jax.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """An aggregation from each sequence's count of model tokens n_i:

        scale_of(n) [K]       each sequence's multiplier (of its token sum)
        count_of(n, C)        the normaliser: a sum over sequences, so micro-batches' counts add
                              (a sequence with n_i = 0, padding, adds nothing)

    Padded rows are one sequence per row (`row_scale`, `count`); packed rows read their
    sequences' counts by segment (`token_scale`, `segment_count`)."""
    scale_of: Callable[[jax.Array], jax.Array]
    count_of: Callable[[jax.Array, float], jax.Array]
    needs_constant: bool = False  # its count reads C (rl.loss.constant_tokens): a learner must be given one

    def row_scale(self, mask) -> jax.Array:
        """Each row's multiplier [B] (one sequence per row)."""
        return self.scale_of(_tokens(mask))

    def count(self, mask, constant: float) -> jax.Array:
        """The normaliser of rows `mask` [B, T] (one sequence per row)."""
        return self.count_of(_tokens(mask), constant)

    def token_scale(self, mask, segment_ids) -> jax.Array:
        """Packed rows: each position's multiplier, its sequence's [B, T]."""
        return on_positions(self.scale_of(segment_tokens(mask, segment_ids)), segment_ids)

    def segment_count(self, mask, segment_ids, constant: float) -> jax.Array:
        """Packed rows: the normaliser of every sequence they hold."""
        return self.count_of(segment_tokens(mask, segment_ids).reshape(-1), constant)


def _tokens(mask):
    return jnp.sum(mask, axis=-1).astype(jnp.float32)


def _sequences(tokens):
    return jnp.sum(tokens > 0).astype(jnp.float32)


def _ones(tokens):
    return jnp.ones(tokens.shape, jnp.float32)


AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")
AGGREGATIONS.register("token_mean", Aggregation(_ones, lambda n, c: jnp.sum(n)))
AGGREGATIONS.register("seq_mean_token_mean", Aggregation(lambda n: 1.0 / jnp.maximum(n, 1.0),
                                                         lambda n, c: _sequences(n)))
AGGREGATIONS.register("seq_mean_token_sum", Aggregation(_ones, lambda n, c: _sequences(n)))
AGGREGATIONS.register("constant", Aggregation(_ones, lambda n, c: _sequences(n) * c, needs_constant=True))


def aggregate(name: str, per_token, mask, constant: float = 1.0):
    """The aggregated loss of one whole batch (no micro-batches): for tests and logging."""
    agg = AGGREGATIONS[name]
    total = jnp.sum(jnp.sum(jnp.where(mask, per_token, 0.0), axis=-1) * agg.row_scale(mask))
    return total / jnp.maximum(agg.count(mask, constant), 1e-9)
