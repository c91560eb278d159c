"""Masks that drop tokens or sequences whose sampler and learner disagree too much.

    geo_mask   sequence dropped unless low <= exp(mean_t log r_t) <= high    (weight 1)
    icepop     token dropped unless low <= r_t <= high;  kept tokens weigh r_t

Sources: the geometric-mean sequence mask, SkyRL's off-policy correction docs (recommends
0.99-1.01) and verl's `decoupled_geo_rs` preset (verl/trainer/config/algorithm.py at
volcengine/verl b178a3c: rollout_rs="seq_mean_k1", "0.999_1.001"). verl's bounds apply to
exp(mean_t -log r_t), the sampler-over-learner ratio, so geo_mask's [low, high] is verl's
"1/high_1/low" (tests/algo/test_corrections.py checks both ways round); IcePop,
inclusionAI's Ring-1T report (2025), "IcePop": J = E[M(k) min(kA, clip(k)A)], M(k) = k on
[alpha, beta] and 0 outside, alpha 0.5, beta 5; NeMo-RL's `icepop` applies the same mask.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND
from rstar2_jax.algo.corrections.base import Correction, CorrectionInputs, register_correction
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class BandSettings(Section):
    """A band [low, high] around 1 the ratio must fall in (it must hold 1: on-policy is kept)."""
    low: float = setting(0.5, "lower bound of the ratio (0 < low <= 1)", min=0.0, max=1.0)
    high: float = setting(5.0, "upper bound of the ratio (>= 1)", min=1.0)

    def rules(self):
        if self.low <= 0:
            yield "low", f"must be > 0 (a ratio is never below 0), got {self.low}"


@dataclasses.dataclass(frozen=True)
class GeoBandSettings(BandSettings):
    """The band for the geometric mean of a sequence's ratios (tight: SkyRL recommends 0.99-1.01)."""
    low: float = setting(0.99, "lower bound of exp(mean log r) (0 < low <= 1)", min=0.0, max=1.0)
    high: float = setting(1.01, "upper bound of exp(mean log r) (>= 1)", min=1.0)


def _inside(log_x, s: BandSettings):
    return (log_x >= math.log(s.low)) & (log_x <= math.log(s.high))


@register_correction("geo_mask", settings=GeoBandSettings, level="sequence")
def geo_mask(x: CorrectionInputs, s: GeoBandSettings) -> Correction:
    return Correction.mask(x.per_token(_inside(x.geo_log_ratio(), s)))


@register_correction("icepop", settings=BandSettings, level="token")
def icepop(x: CorrectionInputs, s: BandSettings) -> Correction:
    log_r = x.token_log_ratio()
    keep = _inside(log_r, s)
    return Correction(jnp.exp(jnp.clip(log_r, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)), keep, jnp.zeros_like(keep))
