"""One GRPO-RoC step's data path: rewards and penalties -> RoC selection -> advantages -> kept
rollouts and trace records (select_step).

A RoC mode (`rl.roc.mode`, the ROC_MODES registry, the one registry of the concept) is the
selection (a function of algo/roc.py) with its settings (`rl.roc.<mode>.*`) and the penalties it
ranks positives by:

    "paper"    the paper's selection; p_err from tool statuses, p_format from the model's own text
    "release"  the released code's selection and its penalties, read off the response text
    "off"      uniform selection (plain GRPO); the paper's penalties still go into the traces

Pure given its inputs (the numpy Generator included), so an RL step is reproducible.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from rstar2_jax.algo import advantages as compute_advantages
from rstar2_jax.algo import group_is_informative, roc_select
from rstar2_jax.algo.reward_shaping import overlong_penalty
from rstar2_jax.algo.roc import (PaperSelection, ReleaseSelection, Selection, UniformSelection, paper_selection,
                                 release_selection, uniform_selection)
from rstar2_jax.config_types import Section, setting
from rstar2_jax.part_sections import PartChoice, part_section
from rstar2_jax.registry import Registry
from rstar2_jax.rewards import format_penalty, tool_error_ratio
from rstar2_jax.rewards.penalties import release_error_ratio, release_format_penalty
from rstar2_jax.rl.seeds import selection_rng
from rstar2_jax.rollout.scoring import Scored
from rstar2_jax.traces import trajectory_record

Penalties = Callable[[Sequence[Scored]], tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class RoCMode:
    select: Selection        # algo/roc.py: which of a group are kept
    penalties: Penalties     # group -> (p_err, p_format) per rollout
    settings: type[Section]  # the selection's settings, rl.roc.<mode>.*


@dataclasses.dataclass
class GroupSelection:
    kept: np.ndarray          # indices into the group
    advantages: np.ndarray    # one per kept rollout
    p_err: np.ndarray         # per rollout of the group
    p_format: np.ndarray


def paper_penalties(group: Sequence[Scored]) -> tuple[np.ndarray, np.ndarray]:
    """(p_err, p_format) per rollout as the paper defines them: tool statuses, the model's own text."""
    return (np.array([tool_error_ratio(s.trajectory.tool_statuses) for s in group]),
            np.array([format_penalty(s.trajectory.assistant_text, len(s.trajectory.turns)) for s in group]))


def release_penalties(group: Sequence[Scored]) -> tuple[np.ndarray, np.ndarray]:
    """(p_err, p_format) per rollout as the released code computes them, from the response text
    (the blocks of calls the sandbox failed to serve left out: penalties.INFRA_TOOL_STATUSES)."""
    texts = [s.trajectory.response_text for s in group]
    return (np.array([release_error_ratio(s.trajectory.response_text, s.trajectory.tool_statuses) for s in group]),
            np.array([release_format_penalty(t) for t in texts]))


ROC_MODES: Registry[RoCMode] = Registry("RoC mode")
ROC_MODES.register("paper", RoCMode(paper_selection, paper_penalties, PaperSelection))
ROC_MODES.register("release", RoCMode(release_selection, release_penalties, ReleaseSelection))
ROC_MODES.register("off", RoCMode(uniform_selection, paper_penalties, UniformSelection))


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
