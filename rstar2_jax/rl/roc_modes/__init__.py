"""RoC modes, one module each, and `rl.roc.*` built from what they register.

    "paper"    the paper's selection; p_err from tool statuses, p_format from the model's own text
    "release"  the released code's selection and its penalties, read off the response text
    "off"      uniform selection (plain GRPO); the paper's penalties still go into the traces

Adding a mode: a module here that registers `RoCMode(select, penalties, settings)` in ROC_MODES
(base.py), and its import below. Its settings appear as `rl.roc.<mode>.*`.
"""

from __future__ import annotations

# Each mode registers itself; this order is the choices' order in --helpconfig and the config.
from rstar2_jax.rl.roc_modes import paper  # noqa: F401
from rstar2_jax.rl.roc_modes import release  # noqa: F401
from rstar2_jax.rl.roc_modes import off  # noqa: F401
from rstar2_jax.core.config_types import setting
from rstar2_jax.core.part_sections import PartChoice, part_section
from rstar2_jax.rl.roc_modes.base import ROC_MODES, Penalties, RoCMode
from rstar2_jax.rl.roc_modes.paper import paper_penalties
from rstar2_jax.rl.roc_modes.release import release_penalties

__all__ = ["Penalties", "ROC_MODES", "RoCConfig", "RoCMode", "paper_penalties", "release_penalties"]


class _RoCBase(PartChoice):
    """`rl.roc.*`: Resample-on-Correct, how 2G rollouts become the G trained on: the mode and
    each mode's own settings (rl.roc.<mode>.*; another mode's may not be changed)."""


RoCConfig = part_section(
    "RoCConfig", ROC_MODES, path="rl.roc", module=__name__, base=_RoCBase,
    moved={"eps": "paper.eps", "min_neg": "release.min_neg", "min_pos": "release.min_pos"},
    selector=("mode", str, setting("paper", "paper | release | off (plain GRPO); docs/FIDELITY.md compares them",
                                   choices=ROC_MODES)),
    common=[("reject_uniform_groups", bool, setting(True, "drop a group whose kept rewards are all equal (zero "
                                                    "advantage)"))])
