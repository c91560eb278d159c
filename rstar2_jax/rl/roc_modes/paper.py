"""`rl.roc.mode=paper`: the paper's selection, positives ranked by p_err (from the tool calls'
statuses) + p_format (from the model's own text)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rstar2_jax.algo.roc import PaperSelection, paper_selection
from rstar2_jax.rewards import format_penalty, tool_error_ratio
from rstar2_jax.rl.roc_modes.base import ROC_MODES, RoCMode
from rstar2_jax.rollout.scoring import Scored


def paper_penalties(group: Sequence[Scored]) -> tuple[np.ndarray, np.ndarray]:
    """(p_err, p_format) per rollout as the paper defines them: tool statuses, the model's own text."""
    return (np.array([tool_error_ratio(s.trajectory.tool_statuses) for s in group]),
            np.array([format_penalty(s.trajectory.assistant_text, len(s.trajectory.turns)) for s in group]))


ROC_MODES.register("paper", RoCMode(paper_selection, paper_penalties, PaperSelection))
