"""Reward shaping before the advantage: DAPO's soft overlong punishment (`rl.overlong.*`).

DAPO (Yu et al. 2025, arXiv 2503.14476, eq. 13), with L_max the stage's response budget and
L_cache the soft band below it:

    R_length(y) = 0                                   |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                  -1                                  L_max < |y|

added to the answer reward. |y| counts every token after the prompt (the budget rStar2 stages
set covers model and tool tokens alike). Off by default (the paper keeps truncated rollouts at
reward 0 and applies no length term).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class OverlongConfig(Section):
    """`rl.overlong.*`: DAPO's soft overlong punishment."""
    cache_tokens: int = setting(0, "L_cache: the band below the stage's max_response_tokens where the penalty "
                                "ramps from 0 to -1 (0: off; DAPO: 4096 of 20480)", min=0)


def overlong_penalty(lengths, max_tokens: int, cache_tokens: int) -> np.ndarray:
    """R_length of DAPO eq. 13 for each response length (0 everywhere when cache_tokens is 0)."""
    lengths = np.asarray(lengths, np.float64)
    if cache_tokens <= 0:
        return np.zeros_like(lengths)
    soft = max_tokens - cache_tokens
    ramp = (soft - lengths) / cache_tokens
    return np.where(lengths <= soft, 0.0, np.where(lengths <= max_tokens, ramp, -1.0))
