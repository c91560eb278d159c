"""Every seed an RL run derives from `seed` (the config's), in one place: each use names its
stream, so two uses never share draws, and every process and every rerun derives the same ones
(a resumed run replays its steps exactly). Strings go through stable_seed (sha256, unlike hash()).
"""

from __future__ import annotations

import numpy as np

from rstar2_jax.core.seeding import stable_seed


def rollout_seed(seed: int, step: int, group: int, sample: int) -> int:
    """Rollout `sample` of the step's problem `group`."""
    return stable_seed(seed, "rollout", step, group, sample)


def topup_seeds(seed: int, step: int, round_: int, problems: int, k: int) -> list[int]:
    """Dynamic sampling's extra round `round_` of the step: k rollouts of each problem, problem-major."""
    return [stable_seed(seed, "topup", step, round_, b, j) for b in range(problems) for j in range(k)]


def prefilter_seeds(seed: int, stage: int, problem_ids, k: int) -> list[int]:
    """The pre-filter before `stage`: k rollouts of each problem (by id, so a resumed pass agrees)."""
    return [stable_seed(seed, "prefilter", stage, pid, j) for pid in problem_ids for j in range(k)]


def eval_seeds(seed: int, label: str, mode: str, problems: int) -> list[int]:
    """An evaluation (`label`: before, after, ...) in `mode` (greedy, sampled): one per problem."""
    return [stable_seed(seed, label, mode, i) for i in range(problems)]


def selection_rng(seed: int, step: int) -> np.random.Generator:
    """RoC's draws at `step` (which failures and which correct rollouts are kept)."""
    return np.random.default_rng([seed, step])


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The training problems' order in `epoch`."""
    return np.random.default_rng([seed, 0x5EED, epoch])
