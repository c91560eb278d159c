"""Resample-on-Correct (RoC): which rollouts of an oversampled group of 2G are trained on.

rStar2-Agent samples 2G rollouts per problem and keeps G. How `keep` is split between the two
sides (documented here because the paper and the released code differ):

- "paper": negatives (reward <= 0) and positives get `keep` in proportion to their counts in the
  group, n_neg = round(keep * negatives / group) (ties round half to even), n_pos = keep - n_neg,
  each clamped to what exists (the other side takes the rest). With 2G -> G this keeps half of each
  side, as in the paper. Negatives are drawn uniformly without replacement (failure modes stay
  diverse); positives without replacement with probability proportional to 1 / (p_total + eps),
  p_total = p_err + p_format (clean successes are preferred, noisy ones still possible).
- "release": microsoft/rStar's released roc.py: both sides sorted by penalty (lowest first),
  proportional counts with Python's round, at least `min_neg` / `min_pos` per side when available,
  the first k of each side; and when both proportional counts fall below their minimums, the whole
  group is kept (that code's behaviour: the group is not down-sampled at all). Where that code's
  independent rounding would not sum to `keep` (never for 2G -> G), positives get the remainder.
- "off": plain GRPO on `keep` rollouts drawn uniformly at random.

`roc_select` is pure given `rng` (a numpy Generator).
"""

from __future__ import annotations

import numpy as np

SELECTION_MODES = ("paper", "release", "off")


def roc_select(rewards, penalties, keep: int, rng: np.random.Generator, mode: str = "paper", *,
               eps: float = 1e-3, min_neg: int = 2, min_pos: int = 2) -> np.ndarray:
    """Indices (sorted) of the rollouts kept from one group."""
    rewards = np.asarray(rewards, dtype=np.float64)
    penalties = np.asarray(penalties, dtype=np.float64)
    n = len(rewards)
    if penalties.shape != rewards.shape:
        raise ValueError(f"rewards and penalties differ in shape: {rewards.shape} vs {penalties.shape}")
    if mode not in SELECTION_MODES:
        raise ValueError(f"unknown RoC mode {mode!r}; expected one of {SELECTION_MODES}")
    if keep >= n:
        return np.arange(n)
    if keep <= 0:
        return np.arange(0)
    if mode == "off":
        return np.sort(rng.choice(n, size=keep, replace=False))
    neg = np.flatnonzero(rewards <= 0)
    pos = np.flatnonzero(rewards > 0)
    if mode == "release":
        return _release(neg, pos, penalties, keep, n, min_neg, min_pos)
    n_neg = int(round(keep * len(neg) / n))
    n_neg = min(n_neg, len(neg))
    n_pos = min(keep - n_neg, len(pos))
    n_neg = keep - n_pos  # if positives ran short, negatives fill the rest (and vice versa)
    chosen_neg = rng.choice(neg, size=n_neg, replace=False) if n_neg else np.arange(0)
    if n_pos:
        weights = 1.0 / (penalties[pos] + eps)
        chosen_pos = rng.choice(pos, size=n_pos, replace=False, p=weights / weights.sum())
    else:
        chosen_pos = np.arange(0)
    return np.sort(np.concatenate([chosen_neg, chosen_pos]).astype(np.int64))


def _release(neg, pos, penalties, keep, n, min_neg, min_pos) -> np.ndarray:
    neg = sorted(neg, key=lambda i: penalties[i])  # stable: ties keep rollout order
    pos = sorted(pos, key=lambda i: penalties[i])
    n_neg = round(len(neg) * keep / n)
    n_pos = round(len(pos) * keep / n)
    if n_neg < min_neg and n_pos < min_pos:
        return np.arange(n)
    # The released code rounds both sides independently and asserts they sum to `keep`; with
    # 2G -> G and Python's half-to-even rounding they always do. For other ratios they may not
    # (10 -> 7 with 5/5 gives 4 + 4): positives then take what negatives leave.
    n_pos = keep - n_neg
    if n_neg <= min(min_neg, len(neg)):
        n_neg = min(min_neg, len(neg))
        n_pos = keep - n_neg
    if n_pos <= min(min_pos, len(pos)):
        n_pos = min(min_pos, len(pos))
        n_neg = keep - n_pos
    n_pos = min(n_pos, len(pos))
    n_neg = min(keep - n_pos, len(neg))
    n_pos = keep - n_neg
    return np.sort(np.asarray(pos[:n_pos] + neg[:n_neg], dtype=np.int64))


def group_is_informative(rewards) -> bool:
    """False when every reward is equal: all advantages are zero and the group teaches nothing."""
    rewards = np.asarray(rewards)
    return bool(len(rewards)) and not np.all(rewards == rewards[0])
