"""`rl.roc.mode=off`: uniform selection (plain GRPO); the paper's penalties are still computed,
for the traces."""

from __future__ import annotations

from rstar2_jax.algo.roc import UniformSelection, uniform_selection
from rstar2_jax.rl.roc_modes.base import ROC_MODES, RoCMode
from rstar2_jax.rl.roc_modes.paper import paper_penalties

ROC_MODES.register("off", RoCMode(uniform_selection, paper_penalties, UniformSelection))
