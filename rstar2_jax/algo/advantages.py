"""Group-relative advantages: pure functions of one group's rewards, registered with their
settings, and `rl.advantage.*` built from what registered.

    rl.advantage.name = "grpo"        # the estimator
    rl.advantage.grpo.eps = 1e-6      # each estimator's own settings (part_sections.py)

Adding an estimator: a function (rewards, settings) -> advantages registered with
`register_advantage(name, settings=...)` above the section's construction (or in a module
imported there).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from rstar2_jax.config_types import Section, setting
from rstar2_jax.part_sections import NoSettings, PartChoice, part_section
from rstar2_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    fn: Callable[[np.ndarray, Section], np.ndarray]   # (one group's rewards, float64, settings) -> advantages
    settings: type[Section] = NoSettings


ADVANTAGES: Registry[AdvantageSpec] = Registry("advantage")


def register_advantage(name: str, *, settings: type[Section] = NoSettings):
    """Decorator: registers an advantage estimator (rewards, settings) -> advantages."""
    def deco(fn):
        ADVANTAGES.register(name, AdvantageSpec(fn, settings))
        return fn
    return deco


@dataclasses.dataclass(frozen=True)
class GRPOAdvantageSettings(Section):
    eps: float = setting(1e-6, "added to the group's std before dividing", min=0.0)


_GRPO_DEFAULTS = GRPOAdvantageSettings()


@register_advantage("grpo", settings=GRPOAdvantageSettings)
def grpo_advantages(rewards, s: GRPOAdvantageSettings = _GRPO_DEFAULTS) -> np.ndarray:
    """(r - mean) / (std + eps) over the kept rollouts of one group (population std)."""
    r = np.asarray(rewards, dtype=np.float64)
    return ((r - r.mean()) / (r.std() + s.eps)).astype(np.float32)


@register_advantage("mean_only")
def mean_centred_advantages(rewards, s: Section | None = None) -> np.ndarray:
    """r - mean (Dr. GRPO): no division by the group's std."""
    del s
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()).astype(np.float32)


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
