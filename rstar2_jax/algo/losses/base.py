"""The loss seam: what every policy loss receives, returns and declares.

A policy loss is one pure function of one struct:

    @register_loss("my_loss", settings=MyLossSettings, stats=("clip_high_fraction",))
    def my_loss(inputs: LossInputs, s: MyLossSettings) -> LossTerms:
        log_ratio = inputs.log_ratio()                 # current vs proximal ("old"), clamped
        ...
        return LossTerms(per_token=..., stats={"clip_high_fraction": ...})

It returns a per-token loss [B, T] (what to *minimise*) and, for each statistic it declared,
a per-token value [B, T]; the seam (`policy_loss_terms`) masks both with `where` (a non-finite
value in padding never reaches a sum), and the update aggregates the per-token loss with the
configured aggregation (algo/aggregation.py) and reports each statistic as its token mean.
The loss never sees padding rules, micro-batches or the normaliser: those are the update's.

`settings` is a config Section the loss owns: it appears as `rl.loss.<name>.*` (with its
documentation in `train --helpconfig`); setting a field of a loss that is not the selected one
is a config error. `aggregations` restricts the aggregations a loss is defined with (GSPO's
objective is a mean over sequences); `default_aggregation` is used when `rl.loss.aggregation`
is not set.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp

from rstar2_jax.core.config_types import Section
from rstar2_jax.core.registry import Registry
from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND
from rstar2_jax.algo.segments import on_positions, segment_totals


@flax.struct.dataclass
class LossInputs:
    """Everything a loss may read. [B, T] arrays are aligned with token positions (position t:
    log p(token_t | tokens_<t)); `mask` is True on the model's own tokens."""
    logprobs: jax.Array               # current parameters (differentiated)
    old_logprobs: jax.Array           # proximal policy: the learner's weights before this update
    advantages: jax.Array             # [B] (one per sequence) or [B, T]
    mask: jax.Array                   # bool [B, T]
    sampler_logprobs: jax.Array | None = None   # the engine's, as it sampled (None when not needed)
    ref_logprobs: jax.Array | None = None       # the frozen reference's (KL runs only)
    # Packed rows (learner/packing.py): several sequences per row, told apart by their id (1, 2,
    # ...; 0 on padding); advantages are then per token. None: one sequence per row.
    segment_ids: jax.Array | None = None
    log_ratio_clamp: float = flax.struct.field(pytree_node=False, default=LOG_RATIO_BOUND)   # rl.loss.log_ratio_clamp

    @property
    def token_advantages(self) -> jax.Array:
        return self.advantages[:, None] if self.advantages.ndim == 1 else self.advantages

    @property
    def seq_lengths(self) -> jax.Array:
        """Model tokens per sequence [B] (0 for padding rows)."""
        return jnp.sum(self.mask, axis=-1)

    def log_ratio(self) -> jax.Array:
        """log(pi / pi_old) per token, clamped to +-log_ratio_clamp before anyone takes exp (verl
        clamps to +-20: a log-ratio of 25 would otherwise give a ratio of 7e10)."""
        return jnp.clip(self.logprobs - self.old_logprobs, -self.log_ratio_clamp, self.log_ratio_clamp)

    def sanitized(self) -> LossInputs:
        """The same inputs with every value outside the mask set to 0 (advantages of empty rows
        too): a non-finite number in padding then reaches neither a sum nor a gradient (a `where`
        on the loss alone still lets 0 x NaN into the backward pass)."""
        def clean(x):
            return None if x is None else jnp.where(self.mask, x, 0.0)
        adv = self.advantages
        adv = jnp.where(self.seq_lengths > 0, adv, 0.0) if adv.ndim == 1 else clean(adv)
        return self.replace(logprobs=clean(self.logprobs), old_logprobs=clean(self.old_logprobs), advantages=adv,
                            sampler_logprobs=clean(self.sampler_logprobs), ref_logprobs=clean(self.ref_logprobs))

    def masked_mean_per_seq(self, x: jax.Array) -> jax.Array:
        """Mean of x over each sequence's model tokens [B] (0 for empty rows); one sequence per
        row (a loss that reduces over sequences uses `sequence_mean`, which also packs)."""
        total = jnp.sum(jnp.where(self.mask, x, 0.0), axis=-1)
        return total / jnp.maximum(self.seq_lengths, 1)

    def sequence_mean(self, x: jax.Array) -> jax.Array:
        """Mean of x over each sequence's model tokens, on that sequence's tokens: [B, 1] for
        one sequence per row, [B, T] for packed rows (a segment mean per row). A loss that
        reduces over a sequence calls this and runs unchanged on either layout."""
        if self.segment_ids is None:
            return self.masked_mean_per_seq(x)[:, None]
        return segment_mean(jnp.where(self.mask, x, 0.0), self.mask, self.segment_ids)


def segment_mean(x: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Per row of x [B, T], the mean of the masked values of each segment, on its positions
    [B, T] (0 where a segment has no masked value)."""
    sums = segment_totals(x, segment_ids)
    counts = segment_totals(mask.astype(x.dtype), segment_ids)
    return on_positions(sums / jnp.maximum(counts, 1.0), segment_ids)


@flax.struct.dataclass
class LossTerms:
    per_token: jax.Array              # [B, T] loss to minimise, before masking and aggregation
    stats: Mapping[str, jax.Array]    # name -> [B, T] per-token value (reported as a token mean)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    fn: Callable[[LossInputs, Section], LossTerms]
    settings: type[Section]
    stats: tuple[str, ...]
    default_aggregation: str = "token_mean"
    aggregations: tuple[str, ...] | None = None   # None: any registered aggregation
    needs_sampler_logprobs: bool = False


LOSSES: Registry[LossSpec] = Registry("policy loss")


def register_loss(name: str, *, settings: type[Section], stats: tuple[str, ...], default_aggregation: str = "token_mean",
                  aggregations: tuple[str, ...] | None = None, needs_sampler_logprobs: bool = False):
    """Decorator: registers a loss function with its settings section and declared statistics."""
    def deco(fn):
        LOSSES.register(name, LossSpec(fn, settings, tuple(stats), default_aggregation, aggregations,
                                       needs_sampler_logprobs))
        return fn
    return deco


# Statistics the seam reports for every loss (token means over the model's tokens).
COMMON_STATS = ("ppo_kl",)


def policy_loss_terms(name: str, inputs: LossInputs, settings: Section) -> LossTerms:
    """The registered loss `name` on `inputs` (sanitized: see LossInputs.sanitized), masked, with
    the common statistics added: ppo_kl = k1 estimate of KL(pi_old || pi) per token, old - new
    (as verl's `ppo_kl`)."""
    spec = LOSSES[name]
    inputs = inputs.sanitized()
    terms = spec.fn(inputs, settings)
    if set(terms.stats) != set(spec.stats):
        raise ValueError(f"loss {name!r} returned stats {sorted(terms.stats)} but declared {sorted(spec.stats)}")
    stats = {k: jnp.where(inputs.mask, v.astype(jnp.float32), 0.0) for k, v in terms.stats.items()}
    stats["ppo_kl"] = jnp.where(inputs.mask, -inputs.log_ratio(), 0.0)
    return LossTerms(per_token=jnp.where(inputs.mask, terms.per_token, 0.0), stats=stats)


def stat_names(name: str) -> tuple[str, ...]:
    """Every statistic the update reports for loss `name` (its own, then the common ones)."""
    return LOSSES[name].stats + COMMON_STATS
