"""Resample-on-Correct (RoC): which rollouts of an oversampled group of 2G are trained on.

rStar2-Agent samples 2G rollouts per problem and keeps G. The paper and the released code split
`keep` between the two sides differently (docs/FIDELITY.md has the table):

- "paper" (section 3): keep floor(|negatives| x keep / n) negatives, drawn uniformly without
  replacement (failure modes stay diverse), and fill the rest of `keep` with positives, drawn
  without replacement with probability proportional to 1 / (p_total + eps), p_total = p_err +
  p_format (clean successes preferred, noisy ones still possible). With 2G -> G that is half the
  negatives rounded down, and the positives get ceil(|positives| / 2): a lone success is kept.
  When one side runs short the other fills `keep`.
- "release": microsoft/rStar's rstar2_agent/down_sample/roc.py as of commit 5e95b19 ("rm sort for
  negative samples (#50)"): proportional counts with Python's round (half to even) on each side,
  raised to at least `min_neg` / `min_pos` where that many exist (the other side takes the
  rest); the whole group is kept when both counts fall below their minimums; positives sorted by
  penalty (stable, lowest first) and the first k taken; negatives taken first-k in rollout order
  (no longer sorted). Its penalties are computed from the response text (rewards.penalties:
  release_penalties). Where its independent rounding does not sum to `keep` (never for 2G -> G)
  the released code asserts; here positives take the remainder.
- "uniform": plain GRPO on `keep` rollouts drawn uniformly at random (RoC off).

Each is a function here with its settings section (PaperSelection, ReleaseSelection); a run's
`rl.roc.mode` names a RoC mode, which pairs a selection with the penalties it ranks by and is the
one registry of the concept (rl/roc_modes/: ROC_MODES). `roc_select` checks its inputs and calls
a selection; it is pure given `rng` (a numpy Generator).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class PaperSelection(Section):
    """`rl.roc.paper.*`."""
    eps: float = setting(1e-3, "positives drawn with probability ~ 1 / (p_err + p_format + eps)", min=0.0)

    def rules(self):
        if self.eps <= 0:
            yield "eps", "must be > 0 (1 / (penalty + eps) with a zero penalty)"


@dataclasses.dataclass(frozen=True)
class ReleaseSelection(Section):
    """`rl.roc.release.*`."""
    min_neg: int = setting(2, "negatives kept at least (when that many exist)", min=0)
    min_pos: int = setting(2, "positives kept at least (when that many exist)", min=0)


@dataclasses.dataclass(frozen=True)
class UniformSelection(Section):
    """Uniform selection has no settings."""


_PAPER_DEFAULTS, _RELEASE_DEFAULTS = PaperSelection(), ReleaseSelection()

# (rewards, penalties, keep, rng[, settings]) -> sorted kept indices, for 0 < keep < n
Selection = Callable[[np.ndarray, np.ndarray, int, np.random.Generator, Section], np.ndarray]


def roc_select(rewards, penalties, keep: int, rng: np.random.Generator, selection: Selection | None = None,
               settings: Section | None = None) -> np.ndarray:
    """Indices (sorted) of the rollouts kept from one group by `selection` (default: the
    paper's) with its `settings` (default: the selection's own defaults)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    penalties = np.asarray(penalties, dtype=np.float64)
    n = len(rewards)
    if penalties.shape != rewards.shape:
        raise ValueError(f"rewards and penalties differ in shape: {rewards.shape} vs {penalties.shape}")
    selection = selection or paper_selection
    if keep >= n:
        return np.arange(n)
    if keep <= 0:
        return np.arange(0)
    if settings is None:
        return selection(rewards, penalties, keep, rng)
    return selection(rewards, penalties, keep, rng, settings)


def uniform_selection(rewards, penalties, keep, rng, s: UniformSelection | None = None) -> np.ndarray:
    del penalties, s
    return np.sort(rng.choice(len(rewards), size=keep, replace=False))


def release_selection(rewards, penalties, keep, rng, s: ReleaseSelection = _RELEASE_DEFAULTS) -> np.ndarray:
    del rng  # deterministic: sorted positives, negatives in rollout order
    return _release(np.flatnonzero(rewards <= 0), np.flatnonzero(rewards > 0), penalties, keep, len(rewards),
                    s.min_neg, s.min_pos)


def paper_selection(rewards, penalties, keep, rng, s: PaperSelection = _PAPER_DEFAULTS) -> np.ndarray:
    eps = s.eps
    neg = np.flatnonzero(rewards <= 0)
    pos = np.flatnonzero(rewards > 0)
    n_neg, n_pos = paper_counts(len(neg), len(pos), keep)
    chosen_neg = rng.choice(neg, size=n_neg, replace=False) if n_neg else np.arange(0)
    if n_pos:
        weights = 1.0 / (penalties[pos] + eps)
        chosen_pos = rng.choice(pos, size=n_pos, replace=False, p=weights / weights.sum())
    else:
        chosen_pos = np.arange(0)
    return np.sort(np.concatenate([chosen_neg, chosen_pos]).astype(np.int64))


def paper_counts(negatives: int, positives: int, keep: int) -> tuple[int, int]:
    """(negatives kept, positives kept) of the paper's split: floor(negatives x keep / n)
    negatives, the rest of `keep` positives; a side that runs short is filled by the other."""
    n = negatives + positives
    n_neg = min(negatives * keep // n, negatives)
    n_pos = min(keep - n_neg, positives)
    return keep - n_pos, n_pos


def _release(neg, pos, penalties, keep, n, min_neg, min_pos) -> np.ndarray:
    neg = list(neg)                                # rollout order: the release no longer sorts these
    pos = sorted(pos, key=lambda i: penalties[i])  # stable: ties keep rollout order
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
