"""Policy losses, as (sum over tokens, token count) so micro-batch accumulation is exact.

Token-level aggregation (DAPO / rStar2-Agent): the loss is the mean over every model token of
the batch, so long and short responses weigh the same per token. A loss returns the *sum* and
the *count*; the caller divides once by the total count of the whole batch.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rstar2_jax.config_types import Section, setting
from rstar2_jax.registry import Registry

LOSSES = Registry("policy loss")
register_loss = LOSSES.register


@register_loss("clip_higher")
def clip_higher_loss(logprobs, old_logprobs, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
                     dual_clip: float | None = None, token_weights=None):
    """PPO clipped surrogate with an asymmetric range [1 - eps_low, 1 + eps_high] (clip-higher).

    logprobs, old_logprobs, mask: [B, T]; advantages: [B] (one per sequence) or [B, T].
    dual_clip c > 1: for negative advantages the loss is also capped at -A * c.
    token_weights [B, T] (e.g. truncated importance weights) scale each token's term of the sum.
    Returns (loss_sum, token_count, stats) with stats summed over tokens (divide by the count).
    """
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    mask = mask.astype(jnp.float32)
    log_ratio = logprobs - old_logprobs
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -adv * dual_clip), per_token)
    stats = {
        "clip_fraction_sum": jnp.sum((clipped > unclipped).astype(jnp.float32) * mask),
        "approx_kl_sum": jnp.sum(0.5 * log_ratio ** 2 * mask),
    }
    weighted = per_token * mask if token_weights is None else per_token * mask * token_weights
    return jnp.sum(weighted), jnp.sum(mask), stats


def truncated_importance_weights(old_logprobs, sampler_logprobs, cap: float):
    """Per-token weights min(pi_learner / pi_sampler, cap) for truncated importance sampling
    (TIS): the engine samples with its own numerics (another kernel, bf16, or weights some
    versions old under asynchronous rollouts), so its distribution is not the learner's; the
    clipped ratio corrects the policy gradient toward the learner's policy while bounding the
    variance. Constants of the update: no gradient flows through them."""
    return jnp.minimum(jnp.exp(old_logprobs - sampler_logprobs), cap)


def kl_penalty(logprobs, ref_logprobs, mask):
    """k3 estimator of KL(pi || ref) per token, summed over the mask (off by default, as in the paper)."""
    diff = ref_logprobs - logprobs
    return jnp.sum((jnp.exp(diff) - diff - 1.0) * mask)


def loss_fn(name: str):
    return LOSSES[name]


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig(Section):
    """`rl.loss.*`: the policy loss and its clipping (the paper: clip-higher 0.2 / 0.28, no dual clip)."""
    name: str = setting("clip_higher", "the policy loss", choices=LOSSES)
    eps_low: float = setting(0.2, "ratio clip below: 1 - eps_low", min=0.0, max=1.0)
    eps_high: float = setting(0.28, "ratio clip above: 1 + eps_high (clip-higher: eps_high > eps_low)", min=0.0)
    dual_clip: float | None = setting(None, "negative advantages: loss capped at -A x dual_clip (None: off)", min=1.0)
