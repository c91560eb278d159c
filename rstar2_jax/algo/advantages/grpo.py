"""`rl.advantage.name=grpo`: the paper's group-normalized advantage."""

from __future__ import annotations

import dataclasses

import numpy as np

from rstar2_jax.algo.advantages.base import register_advantage
from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class GRPOAdvantageSettings(Section):
    eps: float = setting(1e-6, "added to the group's std before dividing", min=0.0)


_GRPO_DEFAULTS = GRPOAdvantageSettings()


@register_advantage("grpo", settings=GRPOAdvantageSettings)
def grpo_advantages(rewards, s: GRPOAdvantageSettings = _GRPO_DEFAULTS) -> np.ndarray:
    """(r - mean) / (std + eps) over the kept rollouts of one group (population std)."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + s.eps)).astype(np.float32)
