"""Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
AReaL's asynchronous PPO, arXiv 2505.24298).

The policy loss already clips pi / pi_prox, where pi_prox is the learner's recomputed log-probs
(the proximal policy); decoupled PPO adds the behaviour weight pi_prox / pi_behav, pi_behav the
sampler's, which makes the update an importance-sampled estimate under the policy that
actually sampled. AReaL drops the tokens whose behaviour weight exceeds the cap rather than
truncating them (areal/utils/functional/functional.py `ppo_actor_loss_fn` with
`RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=cap)` at
inclusionAI/AReaL 4aef98d, 2026-05-21; the older `behav_imp_weight_cap` it replaced):

    w_t = pi_prox(y_t) / pi_behav(y_t),   token dropped when w_t > cap   (cap None: none dropped)

One difference on purpose: AReaL divides the loss by the token count *before* the drop (a dropped
token still counts, so a step with many stale tokens takes a smaller step); here, as for every
correction (base.py), a dropped token leaves the count too, which is verl's rule for its rejection
masks. Under token_mean the two differ by N_kept / N (tests/algo/test_corrections.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND
from rstar2_jax.algo.corrections.base import Correction, CorrectionInputs, register_correction
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class DecoupledSettings(Section):
    """AReaL's upper bound on the behaviour weight (None: no cap; AReaL's default `upper` is 5)."""
    cap: float | None = setting(5.0, "tokens whose behaviour weight pi_prox / pi_behav exceeds it are dropped "
                                "(None: kept whatever their weight)", min=1.0)

    def rules(self):
        if self.cap is not None and self.cap <= 1.0:
            yield "cap", f"must be > 1 (a cap at 1 drops every token the learner prefers), got {self.cap}"


@register_correction("decoupled_ppo", settings=DecoupledSettings, level="token")
def decoupled_ppo(x: CorrectionInputs, s: DecoupledSettings) -> Correction:
    log_w = x.token_log_ratio()
    keep = jnp.ones(log_w.shape, bool) if s.cap is None else log_w <= math.log(s.cap)
    return Correction(jnp.exp(jnp.clip(log_w, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)), keep, jnp.zeros_like(keep))
