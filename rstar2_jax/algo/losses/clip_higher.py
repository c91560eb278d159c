"""Token-level PPO clip with an asymmetric range (clip-higher, DAPO; the rStar2-Agent paper's loss).

    ratio_t = pi(y_t) / pi_old(y_t)
    loss_t  = max(-A ratio_t, -A clip(ratio_t, 1 - eps_low, 1 + eps_high))
    dual clip c (Ye et al. 2020, arXiv 1912.09729): for A < 0 the loss is also capped at -A c.

Sources: the rStar2-Agent paper (arXiv 2508.20722) eq. (2) with eps_low 0.2, eps_high 0.28;
verl `compute_policy_loss_vanilla` (verl/trainer/ppo/core_algos.py), which the released code
runs, always applies the dual clip with c = clip_ratio_c = 3. docs/FIDELITY.md says which is
the default here and why.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from rstar2_jax.algo.losses.base import LossInputs, LossTerms, register_loss
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class ClipHigherSettings(Section):
    """`rl.loss.clip_higher.*`: the PPO clip range (the paper: 0.2 / 0.28) and the dual clip."""
    eps_low: float = setting(0.2, "ratio clipped below at 1 - eps_low", min=0.0, max=1.0)
    eps_high: float = setting(0.28, "ratio clipped above at 1 + eps_high (clip-higher: eps_high > eps_low)", min=0.0)
    dual_clip: float | None = setting(None, "A < 0: loss capped at -A x dual_clip (None: off, the paper's formula; "
                                      "3: the released code's, through verl)", min=1.0)

    def rules(self):
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            yield "dual_clip", f"must be > 1 (a cap at or below the unclipped loss), got {self.dual_clip}"


@register_loss("clip_higher", settings=ClipHigherSettings,
               stats=("clip_low_fraction", "clip_high_fraction", "dual_clip_fraction"))
def clip_higher_loss(inputs: LossInputs, s: ClipHigherSettings) -> LossTerms:
    adv = inputs.token_advantages
    ratio = jnp.exp(inputs.log_ratio())
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - s.eps_low, 1.0 + s.eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    binds = clipped > unclipped           # A > 0: ratio above 1 + eps_high; A < 0: below 1 - eps_low
    dual = jnp.zeros_like(binds)
    if s.dual_clip is not None:
        cap = -adv * s.dual_clip
        dual = (adv < 0) & (per_token > cap)
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, cap), per_token)
    return LossTerms(per_token, {"clip_low_fraction": binds & (adv < 0), "clip_high_fraction": binds & (adv > 0),
                                 "dual_clip_fraction": dual})
