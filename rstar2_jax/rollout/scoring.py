"""Rollouts over a problem set and the numbers a researcher reads off them."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from typing import Callable, Sequence

import numpy as np

from rstar2_jax.rewards import answer_reward, tool_error_ratio
from rstar2_jax.rollout import AgentConfig, Trajectory, run_agent
from rstar2_jax.timeline import span


def stable_seed(*parts) -> int:
    """A 31-bit seed from parts, the same in every process (unlike hash() of strings)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") >> 1


@dataclasses.dataclass
class Scored:
    trajectory: Trajectory
    reward: float


async def rollout_problems(engine, sandbox, tokenizer, questions: Sequence[str], golds: Sequence[str],
                           cfg: AgentConfig, seeds: Sequence[int], *,
                           grader: Callable[[str, str], float] = answer_reward, progress=None) -> list[Scored]:
    """All rollouts concurrently, graded by `grader(response, gold)`; `progress` (e.g. a tqdm
    bar) is updated as each one finishes."""
    async def one(q, s):
        t = await run_agent(engine, sandbox, tokenizer, q, cfg, seed=s)
        if progress is not None:
            progress.update(1)
        return t

    trajs = await asyncio.gather(*(one(q, s) for q, s in zip(questions, seeds)))
    with span("reward"):
        return [Scored(t, grader(t.response_text, g)) for t, g in zip(trajs, golds)]


def summarize(scored: Sequence[Scored]) -> dict[str, float]:
    """accuracy, tool-error ratio in correct trajectories, mean tool calls, mean response tokens."""
    rewards = np.array([s.reward for s in scored])
    correct = [s.trajectory for s in scored if s.reward > 0]
    with_tools = [t for t in correct if t.tool_statuses]
    return {
        "accuracy": float(rewards.mean()) if len(rewards) else 0.0,
        "tool_error_ratio_correct": float(np.mean([tool_error_ratio(t.tool_statuses) for t in with_tools]))
        if with_tools else 0.0,
        "mean_tool_calls": float(np.mean([len(s.trajectory.tool_statuses) for s in scored])) if scored else 0.0,
        "mean_response_tokens": float(np.mean([s.trajectory.num_response_tokens for s in scored])) if scored else 0.0,
    }
