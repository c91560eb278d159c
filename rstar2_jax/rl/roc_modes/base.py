"""What a RoC mode is: a selection (a pure function, algo/roc.py for the built-in ones) with its
settings (`rl.roc.<mode>.*`) and the penalties it ranks a group's positives by; and ROC_MODES,
the one registry of the concept (`rl.roc.mode`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from rstar2_jax.algo.roc import Selection
from rstar2_jax.core.config_types import Section
from rstar2_jax.core.registry import Registry
from rstar2_jax.rollout.scoring import Scored

Penalties = Callable[[Sequence[Scored]], tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class RoCMode:
    select: Selection        # which of a group are kept (algo/roc.py's law: roc_select)
    penalties: Penalties     # group -> (p_err, p_format) per rollout
    settings: type[Section]  # the selection's settings, rl.roc.<mode>.*


ROC_MODES: Registry[RoCMode] = Registry("RoC mode")
