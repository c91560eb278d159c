"""What an advantage estimator is: a pure function of one group's rewards and its settings,
registered with them (ADVANTAGES, `register_advantage`)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from rstar2_jax.core.config_types import Section
from rstar2_jax.core.part_sections import NoSettings
from rstar2_jax.core.registry import Registry


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
