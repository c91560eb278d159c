"""GSPO: the importance ratio and its clip at the sequence level (Zheng et al. 2025, arXiv 2507.18071).

    s_i      = exp( mean_t log(pi(y_i,t) / pi_old(y_i,t)) )           (eq. 7: the length-normalised ratio)
    loss_i   = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))  (eq. 5, averaged over sequences)

Implemented per token as verl's `compute_policy_loss_gspo` does (the "GSPO-token" form of
eq. 13): s_i,t = sg(s_i) pi(y_i,t) / sg(pi(y_i,t)), whose value is s_i on every token and whose
gradient, averaged over the sequence's tokens, is the gradient of s_i. The sequence mean of
token means (the only aggregation it is defined with) then gives eq. 5. verl also caps log s_i,t
at 10. On one-token responses it is token PPO (tests check that law).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rstar2_jax.algo.losses.base import LossInputs, LossTerms, register_loss
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class GSPOSettings(Section):
    """`rl.loss.gspo.*`: the sequence-ratio clip range (the paper's 3e-4 / 4e-4, section 5.1)."""
    eps_low: float = setting(3e-4, "sequence ratio clipped below at 1 - eps_low", min=0.0, max=1.0)
    eps_high: float = setting(4e-4, "sequence ratio clipped above at 1 + eps_high", min=0.0)


@register_loss("gspo", settings=GSPOSettings, stats=("clip_low_fraction", "clip_high_fraction"),
               default_aggregation="seq_mean_token_mean", aggregations=("seq_mean_token_mean",))
def gspo_loss(inputs: LossInputs, s: GSPOSettings) -> LossTerms:
    adv = inputs.token_advantages
    log_seq_ratio = inputs.sequence_mean(inputs.log_ratio())
    lp = inputs.logprobs
    log_token_ratio = jnp.minimum(lp - jax.lax.stop_gradient(lp) + jax.lax.stop_gradient(log_seq_ratio), 10.0)
    ratio = jnp.exp(log_token_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - s.eps_low, 1.0 + s.eps_high)
    binds = clipped > unclipped
    return LossTerms(jnp.maximum(unclipped, clipped),
                     {"clip_low_fraction": binds & (adv < 0), "clip_high_fraction": binds & (adv > 0)})
