"""Importance weights pi_learner / pi_sampler, truncated (TIS) or masked (MIS), per token or
per sequence. With r_t = pi_learner(y_t) / pi_sampler(y_t) and R = prod_t r_t:

    token_tis   w_t = min(r_t, C)                                 every token kept
    seq_tis     w_t = min(R, C)                                   every token kept
    token_mis   w_t = r_t,  token dropped when r_t > C
    seq_mis     w_t = R,    sequence dropped when R > C

Sources: truncated IS, F. Yao et al., "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (2025; C = 2); J. Liu, Y. Li et al., "When Speed Kills Stability"
(2025) for the masked (MIS) variants; verl/trainer/ppo/rollout_corr_helper.py at volcengine/verl
b178a3c (2026-01-29): `compute_rollout_correction_weights(rollout_is="token" | "sequence")` is
token_tis / seq_tis exactly; its sequence rejection is `compute_rollout_rejection_mask(
rollout_rs="seq_sum_k1", rollout_rs_threshold="lower_upper")`, which keeps a sequence when
log(lower) <= sum_t -log r_t <= log(upper), i.e. 1/upper <= R <= 1/lower. seq_mis drops only
above C, which is verl's "seq_sum_k1" with "1/C_inf"; verl's `decoupled_seq_is_rs` preset
("0.5_2.0") also drops sequences with R < 1/2, which seq_mis keeps on purpose (a sequence the
learner finds less likely than the sampler did is down-weighted by R already).
Token weights are unbiased-but-truncated per step; sequence weights are the unbiased
trajectory ratio, with far higher variance on long responses (hence the cap or the mask).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND
from rstar2_jax.algo.corrections.base import Correction, CorrectionInputs, register_correction
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class CapSettings(Section):
    """A cap C on the importance weight (>= 1: a cap below 1 would down-weight on-policy tokens)."""
    cap: float = setting(2.0, "C: the weight's upper bound (TIS: truncated to it; MIS: dropped above it)", min=1.0)


def _exp(log_x):
    return jnp.exp(jnp.clip(log_x, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


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
