"""`rl.roc.mode=release`: the released code's selection and its penalties, read off the response
text (docs/FIDELITY.md compares it with the paper's)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rstar2_jax.algo.roc import ReleaseSelection, release_selection
from rstar2_jax.rewards.penalties import release_error_ratio, release_format_penalty
from rstar2_jax.rl.roc_modes.base import ROC_MODES, RoCMode
from rstar2_jax.rollout.scoring import Scored


def release_penalties(group: Sequence[Scored]) -> tuple[np.ndarray, np.ndarray]:
    """(p_err, p_format) per rollout as the released code computes them, from the response text
    (the blocks of calls the sandbox failed to serve left out: penalties.INFRA_TOOL_STATUSES)."""
    texts = [s.trajectory.response_text for s in group]
    return (np.array([release_error_ratio(s.trajectory.response_text, s.trajectory.tool_statuses) for s in group]),
            np.array([release_format_penalty(t) for t in texts]))


ROC_MODES.register("release", RoCMode(release_selection, release_penalties, ReleaseSelection))
