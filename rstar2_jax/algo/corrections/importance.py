"""Importance weights pi_learner / pi_sampler, truncated (TIS) or masked (MIS), per token or
per sequence. With r_t = pi_learner(y_t) / pi_sampler(y_t) and R = prod_t r_t:

    token_tis   w_t = min(r_t, C)                                 every token kept
    seq_tis     w_t = min(R, C)                                   every token kept
    token_mis   w_t = r_t,  token dropped when r_t > C
    seq_mis     w_t = R,    sequence dropped when R > C

Sources: truncated IS, F. Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025; C = 2); verl `compute_rollout_correction_weights` and
`compute_rollout_rejection_mask` (verl/trainer/ppo/rollout_corr_helper.py; presets token_is,
seq_is, and seq_mis = sequence IS with rejection above the same threshold, lower bound 0);
J. Liu, Y. Li et al., "When Speed Kills Stability" (2025) for the masked (MIS) variants.
Token weights are unbiased-but-truncated per step; sequence weights are the unbiased
trajectory ratio, with far higher variance on long responses (hence the cap or the mask).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from rstar2_jax.algo.corrections.base import SAFETY_BOUND, Correction, CorrectionInputs, register_correction
from rstar2_jax.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class CapSettings(Section):
    """A cap C on the importance weight (>= 1: a cap below 1 would down-weight on-policy tokens)."""
    cap: float = setting(2.0, "C: the weight's upper bound (TIS: truncated to it; MIS: dropped above it)", min=1.0)


def _exp(log_x):
    return jnp.exp(jnp.clip(log_x, -SAFETY_BOUND, SAFETY_BOUND))


@register_correction("token_tis", settings=CapSettings, level="token")
def token_tis(x: CorrectionInputs, s: CapSettings) -> Correction:
    log_r = x.token_log_ratio()
    return Correction.weights(jnp.minimum(_exp(log_r), s.cap), clipped=log_r > math.log(s.cap))


@register_correction("seq_tis", settings=CapSettings, level="sequence")
def seq_tis(x: CorrectionInputs, s: CapSettings) -> Correction:
    log_seq = x.per_token(x.seq_log_ratio())
    return Correction.weights(jnp.minimum(_exp(log_seq), s.cap), clipped=log_seq > math.log(s.cap))


@register_correction("token_mis", settings=CapSettings, level="token")
def token_mis(x: CorrectionInputs, s: CapSettings) -> Correction:
    log_r = x.token_log_ratio()
    keep = log_r <= math.log(s.cap)
    return Correction(_exp(log_r), keep, jnp.zeros_like(keep))


@register_correction("seq_mis", settings=CapSettings, level="sequence")
def seq_mis(x: CorrectionInputs, s: CapSettings) -> Correction:
    log_seq = x.per_token(x.seq_log_ratio())
    keep = log_seq <= math.log(s.cap)
    return Correction(_exp(log_seq), keep, jnp.zeros_like(keep))
