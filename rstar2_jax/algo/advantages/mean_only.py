"""`rl.advantage.name=mean_only`: Dr. GRPO's advantage, centred and not divided by the std
(Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective")."""

from __future__ import annotations

import numpy as np

from rstar2_jax.algo.advantages.base import register_advantage
from rstar2_jax.core.config_types import Section


@register_advantage("mean_only")
def mean_centred_advantages(rewards, s: Section | None = None) -> np.ndarray:
    """r - mean (Dr. GRPO): no division by the group's std."""
    del s
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()).astype(np.float32)
