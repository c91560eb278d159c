"""The training problems a run draws, step by step: the one owner of epoch order, the stage's
problem filter (offline pre-filter or online) and the solved sets.

Two views of one stream, because asynchronous rollouts draw ahead of training:

- the *draw* side (the producer): the position in the per-epoch shuffled order and the offline
  pre-filter's result, advanced by `draw(step)`; each draw returns a snapshot (DataState);
- the *trained* side (the consumer): after step s is trained, `after_training(step, drawn,
  solved_now)` folds in what the step solved (online filter) and returns the state a checkpoint
  after step s saves: the position as of step s's draw, not the producer's, so a resumed run
  draws exactly the problems that were never trained.

The online filter of step s may only use what steps up to s - 1 - max_staleness solved (those
are trained before s is drawn in every process and every rerun), so the draw reads the trained
side's history at that step.
"""

from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable, Sequence

import numpy as np

from rstar2_jax.rl.run_state import DataState
from rstar2_jax.rl.seeds import epoch_rng


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the n training problems in `epoch`: a fresh permutation every epoch, from
    the run seed (as verl's shuffling loader), so a resumed run replays it exactly."""
    return epoch_rng(seed, epoch).permutation(n)


def next_problems(problems: Sequence, pos: int, count: int, seed: int, skip: set[str]) -> tuple[list, int]:
    """`count` problems from position `pos` of the shuffled stream (pos counts problems drawn
    since the run began), skipping ids in `skip`; returns them and the new position."""
    n = len(problems)
    if len(skip.intersection(p.id for p in problems)) >= n:
        raise RuntimeError("every training problem has been filtered out as solved")
    batch, order, epoch = [], None, -1
    while len(batch) < count:
        if pos // n != epoch:
            epoch = pos // n
            order = epoch_order(n, seed, epoch)
        p = problems[order[pos % n]]
        pos += 1
        if p.id not in skip:
            batch.append(p)
    return batch, pos


def solved_ids(problems: Sequence, rewards: Sequence[float], n_roll: int, k: int) -> set[str]:
    """The online filter: problems whose first k of their n_roll rollouts (problem-major) all
    scored (k = n_roll: every rollout). A problem the latest policy solves k/k teaches nothing more."""
    return {p.id for b, p in enumerate(problems) if all(r > 0 for r in rewards[b * n_roll:b * n_roll + k])}


TOPUP_SEED_OFFSET = 0x70F0  # dynamic sampling's stream: its own permutations of the problems

Prefilter = Callable[[int, int], Awaitable[set[str]]]   # (stage index, step) -> ids solved k/k


class DataStream:
    def __init__(self, problems: Sequence, cfg, state: DataState, start_step: int):
        """`cfg`: the RunConfig (seed, stages, rl.batch_problems, rl.max_staleness); `state`: the
        data state of the checkpoint resumed from (a fresh run: DataState())."""
        self.problems, self.cfg = problems, cfg
        self._drawn = state                               # the draw side, as of the latest draw
        self._trained_solved: tuple[str, ...] = state.solved
        self._topup_position = state.topup_position       # dynamic sampling's stream (consumer side)
        self._solved_after = {start_step - 1: state.solved}   # trained step -> solved set after it

    def prefilter_begins(self, step: int) -> bool:
        """Whether drawing step `step` first runs its stage's offline pre-filter (once per stage)."""
        stage_i = self.cfg.stage_index(step)
        stage = self.cfg.stages[stage_i]
        return bool(stage.filter_solved_k) and stage.filter_mode == "offline" and \
            self._drawn.prefiltered_stage != stage_i

    def skipped(self, step: int) -> set[str]:
        """The problems step `step` may not draw: the stage's pre-filter result (offline), or
        those solved k/k by the steps trained before it could start (online: steps up to
        step - 1 - rl.max_staleness; the same set in every process and every rerun)."""
        stage = self.cfg.stage(step)
        if not stage.filter_solved_k:
            return set()
        if stage.filter_mode == "offline":
            return set(self._drawn.solved)
        known = [s for s in self._solved_after if s <= step - 1 - self.cfg.rl.max_staleness]
        return set(self._solved_after[max(known)] if known else self._drawn.solved)

    async def draw(self, step: int, prefilter: Prefilter) -> tuple[list, DataState]:
        """Step `step`'s problems (after the stage's pre-filter, when it begins) and the draw
        side's state right after this draw."""
        if self.prefilter_begins(step):
            stage_i = self.cfg.stage_index(step)
            solved = tuple(sorted(await prefilter(stage_i, step)))
            self._drawn = dataclasses.replace(self._drawn, solved=solved, prefiltered_stage=stage_i)
        problems, position = next_problems(self.problems, self._drawn.position, self.cfg.rl.batch_problems,
                                           self.cfg.seed, self.skipped(step))
        self._drawn = dataclasses.replace(self._drawn, position=position)
        return problems, self._drawn

    def draw_topup(self, step: int, count: int) -> list:
        """`count` extra problems for step `step` (dynamic sampling) from a second shuffled stream
        of the training problems (its own seed and position), advanced only by the consumer in
        step order: the same problems in every process and every rerun. It skips what the step
        may not draw."""
        problems, self._topup_position = next_problems(self.problems, self._topup_position, count,
                                                       self.cfg.seed + TOPUP_SEED_OFFSET, self.skipped(step))
        return problems

    def after_training(self, step: int, drawn: DataState, solved_now: set[str]) -> DataState:
        """The trained side once step `step` (drawn as `drawn`) is trained: its solved set (the
        pre-filter's under an offline stage; else what earlier steps solved plus `solved_now`,
        the online filter's find) and the state a checkpoint after this step saves."""
        stage = self.cfg.stage(step)
        if stage.filter_solved_k and stage.filter_mode == "offline":
            solved = set(drawn.solved)
        else:
            solved = set(self._trained_solved) | solved_now
        self._trained_solved = tuple(sorted(solved))
        self._solved_after[step] = self._trained_solved
        return DataState(drawn.position, self._trained_solved, drawn.prefiltered_stage, self._topup_position)
