"""Rollouts over a problem set and the numbers a researcher reads off them."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Sequence

import numpy as np

from rstar2_jax.rewards import Grade, Grader, tool_error_ratio
from rstar2_jax.rewards.penalties import infra_error_count
from rstar2_jax.rollout import AgentConfig, Trajectory, run_agent
from rstar2_jax.rollout.journal import StepJournal
from rstar2_jax.core.timeline import span


@dataclasses.dataclass
class Scored:
    trajectory: Trajectory
    reward: float
    answer: str | None = None    # its answer in the graded format; None: none there (a format failure)

    @classmethod
    def graded(cls, trajectory: Trajectory, grade: Grade) -> "Scored":
        return cls(trajectory, grade.reward, grade.answer)


async def rollout_problems(engine, sandbox, tokenizer, questions: Sequence[str], golds: Sequence[str],
                           cfg: AgentConfig, seeds: Sequence[int], *,
                           grader: Callable[[str, str], Grade] = Grader(), progress=None,
                           journal: StepJournal | None = None, indices: Sequence[int] | None = None) -> list[Scored]:
    """All rollouts concurrently, graded by `grader(response, gold)` (a Grade: reward and the answer
    in the expected format) on the text the model wrote (Trajectory.graded_text); `progress` (e.g.
    a tqdm bar) is updated as each one finishes. With
    `journal`, rollout i is saved turn by turn (and resumed) under its index `indices[i]` in the
    step (default i): rollout/journal.py."""
    indices = range(len(questions)) if indices is None else indices

    async def one(q, s, i):
        rollout_journal = journal.rollout(i, q, s, cfg) if journal is not None else None
        t = await run_agent(engine, sandbox, tokenizer, q, cfg, seed=s, journal=rollout_journal)
        if progress is not None:
            progress.update(1)
        return t

    trajs = await asyncio.gather(*(one(q, s, i) for q, s, i in zip(questions, seeds, indices)))
    with span("reward"):
        return [Scored.graded(t, grader(t.graded_text, g)) for t, g in zip(trajs, golds)]


async def scored_rollout(engine, sandbox, tokenizer, question: str, gold: str, cfg: AgentConfig, seed: int, *,
                         grader: Callable[[str, str], Grade] = Grader(), journal=None) -> Scored:
    """One rollout, graded as soon as it ends (a step whose groups are cut and carried needs each
    rollout's result on its own: rl/carry.py)."""
    t = await run_agent(engine, sandbox, tokenizer, question, cfg, seed=seed, journal=journal)
    with span("reward"):
        return Scored.graded(t, grader(t.graded_text, gold))


@dataclasses.dataclass(frozen=True)
class RolloutOutcome:
    """What the summaries read off one rollout (so results kept on disk summarize alike)."""
    reward: float
    tool_statuses: tuple[str, ...]
    response_tokens: int
    format_failure: bool = False      # no answer in the graded format (results kept before it: False)

    @classmethod
    def of(cls, s: "Scored | RolloutOutcome") -> "RolloutOutcome":
        if isinstance(s, RolloutOutcome):
            return s
        return cls(float(s.reward), tuple(s.trajectory.tool_statuses), int(s.trajectory.num_response_tokens),
                   s.answer is None)


# One definition per metric, the same names in train (eval records), evaluate, traces and the
# notebooks; README's metric table lists them (tests/test_evaluate.py checks it does).
METRICS = {
    "accuracy": "share of rollouts whose answer is right (reward 1), over rollouts",
    "format_failure_rate": "share of rollouts with no answer in the graded answer format (scored 0 whatever the math; "
                           "the rest of the wrong ones answered and were wrong)",
    "tool_error_ratio_correct": "mean over correct rollouts with at least one tool call of that rollout's "
                                "share of failed calls (the quantity RoC ranks by)",
    "tool_error_ratio_all": "failed calls / calls the sandbox served, pooled over every rollout",
    "tool_infra_error_rate": "calls the sandbox failed to serve (after a retry; not the code's fault, not in p_err) / "
                             "all calls, pooled over every rollout",
    "mean_tool_calls": "tool calls per rollout, mean over rollouts",
    "mean_response_tokens": "tokens after the prompt (model and tool output) per rollout, mean over rollouts",
}


def summarize(scored: Sequence["Scored | RolloutOutcome"]) -> dict[str, float]:
    """The METRICS of a set of rollouts."""
    outcomes = [RolloutOutcome.of(s) for s in scored]
    correct_with_tools = [o for o in outcomes if o.reward > 0 and o.tool_statuses]
    calls = [st for o in outcomes for st in o.tool_statuses]
    return {
        "accuracy": float(np.mean([o.reward for o in outcomes])) if outcomes else 0.0,
        "format_failure_rate": float(np.mean([o.format_failure for o in outcomes])) if outcomes else 0.0,
        "tool_error_ratio_correct": float(np.mean([tool_error_ratio(o.tool_statuses) for o in correct_with_tools]))
        if correct_with_tools else 0.0,
        "tool_error_ratio_all": tool_error_ratio(calls) if len(calls) > infra_error_count(calls) else 0.0,
        "tool_infra_error_rate": infra_error_count(calls) / len(calls) if calls else 0.0,
        "mean_tool_calls": float(np.mean([len(o.tool_statuses) for o in outcomes])) if outcomes else 0.0,
        "mean_response_tokens": float(np.mean([o.response_tokens for o in outcomes])) if outcomes else 0.0,
    }
