"""Group-relative advantages, one module each, and `rl.advantage.*` built from what they register.

    rl.advantage.name = "grpo"        # the estimator
    rl.advantage.grpo.eps = 1e-6      # each estimator's own settings (core/part_sections.py)

Adding an estimator: a module here with a function (rewards, settings) -> advantages registered
with `register_advantage(name, settings=...)` (base.py), and its import below.
"""

from __future__ import annotations

import numpy as np

from rstar2_jax.algo.advantages import grpo, mean_only  # noqa: F401  (each registers its estimator)
from rstar2_jax.algo.advantages.base import ADVANTAGES, AdvantageSpec, register_advantage
from rstar2_jax.algo.advantages.grpo import GRPOAdvantageSettings, grpo_advantages
from rstar2_jax.algo.advantages.mean_only import mean_centred_advantages
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.core.part_sections import PartChoice, part_section

__all__ = ["ADVANTAGES", "AdvantageConfig", "AdvantageSpec", "GRPOAdvantageSettings", "advantages",
           "grpo_advantages", "mean_centred_advantages", "register_advantage"]


class _AdvantageBase(PartChoice):
    """`rl.advantage.*`: the group-relative advantage estimator and each one's own settings."""


AdvantageConfig = part_section(
    "AdvantageConfig", ADVANTAGES, path="rl.advantage", module=__name__, base=_AdvantageBase,
    selector=("name", str, setting("grpo", "the estimator: grpo (the paper) | mean_only (Dr. GRPO)",
                                   choices=ADVANTAGES)))


def advantages(cfg: Section | str, rewards) -> np.ndarray:
    """One group's advantages by the estimator `cfg` chooses (an AdvantageConfig, or a name for
    its default settings)."""
    cfg = AdvantageConfig(name=cfg) if isinstance(cfg, str) else cfg
    return ADVANTAGES[cfg.name].fn(np.asarray(rewards, dtype=np.float64), cfg.settings())
