"""Group-relative advantages: pure functions, registered by name."""

from __future__ import annotations

from typing import Callable

import numpy as np

ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGES[name] = fn
        return fn
    return deco


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
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage {name!r}; registered: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, eps=eps)
