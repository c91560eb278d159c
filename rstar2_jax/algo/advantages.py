"""Group-relative advantages: pure functions, registered by name."""

from __future__ import annotations

import numpy as np

from rstar2_jax.registry import Registry

ADVANTAGES = Registry("advantage")
register_advantage = ADVANTAGES.register


@register_advantage("grpo")
def grpo_advantages(rewards, eps: float = 1e-6) -> np.ndarray:
    """(r - mean) / (std + eps) over the kept rollouts of one group (population std)."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + eps)).astype(np.float32)


@register_advantage("mean_only")
def mean_centred_advantages(rewards, eps: float = 1e-6) -> np.ndarray:
    """r - mean (Dr. GRPO): no division by the group's std."""
    del eps
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()).astype(np.float32)


def advantages(name: str, rewards, eps: float = 1e-6) -> np.ndarray:
    return ADVANTAGES[name](rewards, eps=eps)
