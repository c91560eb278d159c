"""One GRPO-RoC step's data path: rewards and penalties -> RoC selection -> advantages -> kept
rollouts and trace records (select_step).

A RoC mode (`rl.roc.mode`: paper, release or off) is a module of rl/roc_modes/: a selection
with its settings (`rl.roc.<mode>.*`) and the penalties it ranks positives by; `rl.roc.*`
(RoCConfig) is built there from what registered.

Pure given its inputs (the numpy Generator included), so an RL step is reproducible.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from rstar2_jax.algo import advantages as compute_advantages
from rstar2_jax.algo import group_is_informative, roc_select
from rstar2_jax.algo.reward_shaping import overlong_penalty
from rstar2_jax.rl.seeds import selection_rng
from rstar2_jax.rollout.scoring import Scored
from rstar2_jax.traces import trajectory_record


@dataclasses.dataclass
class GroupSelection:
    kept: np.ndarray          # indices into the group
    advantages: np.ndarray    # one per kept rollout
    p_err: np.ndarray         # per rollout of the group
    p_format: np.ndarray


def select_group(group: Sequence[Scored], keep: int, rng: np.random.Generator, *, roc, advantage,
                 rewards: Sequence[float] | None = None) -> GroupSelection:
    """RoC on one group (`roc`: a RoCConfig, `advantage`: an AdvantageConfig); `rewards`
    (default: each rollout's own) is what RoC and the advantage read (a shaped reward, e.g. with
    DAPO's overlong term)."""
    mode = roc.spec()
    rewards = np.array([s.reward for s in group] if rewards is None else rewards, np.float64)
    p_err, p_format = mode.penalties(group)
    kept = roc_select(rewards, p_err + p_format, keep, rng, mode.select, roc.settings())
    if roc.reject_uniform_groups and not group_is_informative(rewards[kept]):
        kept = kept[:0]
    adv = compute_advantages(advantage, rewards[kept]) if len(kept) else np.zeros(0, np.float32)
    return GroupSelection(kept, adv, p_err, p_format)


@dataclasses.dataclass(frozen=True)
class KeptRollout:
    trajectory: Any        # rollout.Trajectory
    advantage: float
    record: int            # index of its trace record
    group: int             # index of its problem in the step
    reward: float          # the (shaped) reward its advantage came from


def select_step(cfg, step: int, problems: Sequence, scored: Sequence[Scored], *,
                max_groups: int | None = None) -> tuple[list[KeptRollout], list[dict]]:
    """RoC on every group of a step (`cfg`: the RunConfig; `scored`: every process's rollouts,
    problem-major): the kept rollouts with their advantages, and the trace record of every
    rollout (kept or not). Rewards are shaped first (rl.overlong). With `max_groups`, groups past
    that many trained ones are not trained on (dynamic sampling's surplus). The RoC draws come
    from (seed, step), so a rerun keeps the same."""
    n_roll = cfg.rl.rollouts_per_problem
    rng = selection_rng(cfg.seed, step)
    budget = cfg.stage(step).max_response_tokens
    kept, records, groups = [], [], 0
    for b, problem in enumerate(problems):
        group = scored[b * n_roll:(b + 1) * n_roll]
        lengths = [s.trajectory.num_response_tokens for s in group]
        shaped = np.array([s.reward for s in group]) + overlong_penalty(lengths, budget, cfg.rl.overlong.cache_tokens)
        sel = select_group(group, cfg.rl.group_size, rng, roc=cfg.rl.roc, advantage=cfg.rl.advantage, rewards=shaped)
        full = max_groups is not None and groups >= max_groups
        adv_of = {} if full else dict(zip(sel.kept.tolist(), sel.advantages.tolist()))
        groups += bool(adv_of)
        for j, s in enumerate(group):
            t = s.trajectory
            if j in adv_of:
                kept.append(KeptRollout(t, adv_of[j], len(records), b, float(shaped[j])))
            records.append(trajectory_record(
                t, run=cfg.run_name, step=step, problem_id=problem.id, sample_index=j, problem=problem.question,
                gold=problem.answer, engine=cfg.rollout.engine, extracted_answer=s.answer, reward=s.reward,
                p_err=float(sel.p_err[j]), p_format=float(sel.p_format[j]), kept=j in adv_of,
                advantage=float(adv_of.get(j, 0.0))))
    return kept, records


def advantages_with_kl(kept: Sequence[KeptRollout], kl: np.ndarray, coef: float, advantage) -> np.ndarray:
    """Each kept rollout's advantage recomputed over its group with reward - coef x its
    sequence KL to the reference (verl's KL in the reward: the penalised score, then the
    group advantage)."""
    out = np.zeros(len(kept), np.float32)
    for g in sorted({k.group for k in kept}):
        rows = [i for i, k in enumerate(kept) if k.group == g]
        out[rows] = compute_advantages(advantage, [kept[i].reward - coef * kl[i] for i in rows])
    return out
