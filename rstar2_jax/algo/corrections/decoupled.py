"""Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
AReaL's asynchronous PPO, arXiv 2505.24298).

The policy loss already clips pi / pi_prox, where pi_prox is the learner's recomputed log-probs
(the proximal policy); decoupled PPO adds the behaviour weight pi_prox / pi_behav, pi_behav the
sampler's, which makes the update an importance-sampled estimate under the policy that
actually sampled. AReaL's `ppo_actor_loss_fn` drops the tokens whose
behaviour weight exceeds `behav_imp_weight_cap` (must be > 1) rather than truncating them:

    w_t = pi_prox(y_t) / pi_behav(y_t),   token dropped when w_t > cap   (cap None: none dropped)
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from rstar2_jax.algo.corrections.base import SAFETY_BOUND, Correction, CorrectionInputs, register_correction
from rstar2_jax.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class DecoupledSettings(Section):
    """AReaL's `behav_imp_weight_cap` (None: no cap; AReaL's examples use 5)."""
    cap: float | None = setting(5.0, "tokens whose behaviour weight pi_prox / pi_behav exceeds it are dropped "
                                "(None: kept whatever their weight)", min=1.0)

    def rules(self):
        if self.cap is not None and self.cap <= 1.0:
            yield "cap", f"must be > 1 (AReaL's rule: a cap at 1 drops every token the learner prefers), got {self.cap}"


@register_correction("decoupled_ppo", settings=DecoupledSettings, level="token")
def decoupled_ppo(x: CorrectionInputs, s: DecoupledSettings) -> Correction:
    log_w = x.token_log_ratio()
    keep = jnp.ones(log_w.shape, bool) if s.cap is None else log_w <= math.log(s.cap)
    return Correction(jnp.exp(jnp.clip(log_w, -SAFETY_BOUND, SAFETY_BOUND)), keep, jnp.zeros_like(keep))
