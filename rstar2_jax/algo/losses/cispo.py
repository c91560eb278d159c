"""CISPO: clip the importance weight, not the update (MiniMax-M1, arXiv 2506.13585, eq. 4).

    loss_t = -sg(clip(ratio_t, 1 - eps_low, 1 + eps_high)) A log pi(y_t)

Every token keeps its gradient (a PPO clip drops the gradient of clipped tokens, often the rare
"reflection" tokens); only the weight is truncated, and no gradient flows through it. Token-mean
aggregation, as the paper (1 / sum |o_i|). Matches verl's `compute_policy_loss_cispo`.
MiniMax-M1 sets no lower bound in effect (eps_low large) and tunes eps_high only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rstar2_jax.algo.losses.base import LossInputs, LossTerms, register_loss
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class CISPOSettings(Section):
    """`rl.loss.cispo.*`: the truncation of the importance weight."""
    eps_low: float = setting(1.0, "weight clipped below at 1 - eps_low (1.0: no lower bound, as MiniMax-M1)",
                             min=0.0, max=1.0)
    eps_high: float = setting(0.28, "weight clipped above at 1 + eps_high (the one MiniMax-M1 tunes)", min=0.0)


@register_loss("cispo", settings=CISPOSettings, stats=("clip_low_fraction", "clip_high_fraction"))
def cispo_loss(inputs: LossInputs, s: CISPOSettings) -> LossTerms:
    ratio = jnp.exp(inputs.log_ratio())
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - s.eps_low, 1.0 + s.eps_high))
    return LossTerms(-weight * inputs.token_advantages * inputs.logprobs,
                     {"clip_low_fraction": ratio < 1.0 - s.eps_low, "clip_high_fraction": ratio > 1.0 + s.eps_high})
