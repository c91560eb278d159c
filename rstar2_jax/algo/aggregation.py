"""How per-token losses become one number: registered aggregations, exact under micro-batching.

An aggregation is two pure functions of the loss mask:

    row_scale(mask) [B]       what each sequence's token sum is multiplied by
    count(mask, C)  scalar    the normaliser of the whole (mini-)batch; never depends on the weights

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

from rstar2_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Aggregation:
    row_scale: Callable[[jax.Array], jax.Array]
    count: Callable[[jax.Array, float], jax.Array]
    needs_constant: bool = False  # its count reads C (rl.loss.constant_tokens): a learner must be given one


def _tokens(mask):
    return jnp.sum(mask, axis=-1).astype(jnp.float32)


def _sequences(mask):
    return jnp.sum(_tokens(mask) > 0).astype(jnp.float32)


def _ones(mask):
    return jnp.ones(mask.shape[:1], jnp.float32)


AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")
AGGREGATIONS.register("token_mean", Aggregation(_ones, lambda mask, c: jnp.sum(_tokens(mask))))
AGGREGATIONS.register("seq_mean_token_mean", Aggregation(lambda mask: 1.0 / jnp.maximum(_tokens(mask), 1.0),
                                                         lambda mask, c: _sequences(mask)))
AGGREGATIONS.register("seq_mean_token_sum", Aggregation(_ones, lambda mask, c: _sequences(mask)))
AGGREGATIONS.register("constant", Aggregation(_ones, lambda mask, c: _sequences(mask) * c, needs_constant=True))


def aggregate(name: str, per_token, mask, constant: float = 1.0):
    """The aggregated loss of one whole batch (no micro-batches): for tests and logging."""
    agg = AGGREGATIONS[name]
    total = jnp.sum(jnp.sum(jnp.where(mask, per_token, 0.0), axis=-1) * agg.row_scale(mask))
    return total / jnp.maximum(agg.count(mask, constant), 1e-9)
