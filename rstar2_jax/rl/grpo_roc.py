"""One GRPO-RoC step's data path: rewards and penalties -> RoC selection -> advantages -> batch.

Pure given its inputs (the numpy Generator included), so an RL step is reproducible.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rstar2_jax.algo import advantages as compute_advantages
from rstar2_jax.algo import group_is_informative, roc_select
from rstar2_jax.rewards import format_penalty, tool_error_ratio
from rstar2_jax.rewards.penalties import release_error_ratio, release_format_penalty
from rstar2_jax.rl.evaluation import Scored


@dataclasses.dataclass
class GroupSelection:
    kept: np.ndarray          # indices into the group
    advantages: np.ndarray    # one per kept rollout
    p_err: np.ndarray         # per rollout of the group
    p_format: np.ndarray


def penalties(group: Sequence[Scored], mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(p_err, p_format) per rollout: the paper's (tool statuses, the model's own text), or in
    "release" mode the released code's (read off the response text)."""
    if mode == "release":
        texts = [s.trajectory.response_text for s in group]
        return (np.array([release_error_ratio(t) for t in texts]), np.array([release_format_penalty(t) for t in texts]))
    return (np.array([tool_error_ratio(s.trajectory.tool_statuses) for s in group]),
            np.array([format_penalty(s.trajectory.assistant_text, len(s.trajectory.turns)) for s in group]))


def select_group(group: Sequence[Scored], keep: int, rng: np.random.Generator, *, mode: str, eps: float,
                 min_neg: int, min_pos: int, advantage: str, reject_uniform: bool) -> GroupSelection:
    rewards = np.array([s.reward for s in group])
    p_err, p_format = penalties(group, mode)
    kept = roc_select(rewards, p_err + p_format, keep, rng, mode, eps=eps, min_neg=min_neg, min_pos=min_pos)
    if reject_uniform and not group_is_informative(rewards[kept]):
        kept = kept[:0]
    adv = compute_advantages(advantage, rewards[kept]) if len(kept) else np.zeros(0, np.float32)
    return GroupSelection(kept, adv, p_err, p_format)
