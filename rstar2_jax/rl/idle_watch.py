"""A run that is not learning says so: consecutive RL steps that kept no rollout (every group's
rewards were equal, so GRPO's advantages are all zero and there is no update) warn with the likely
cause read off the step's metrics, and `rl.idle.stop_after` such steps stop the run.

A short SFT that leaves the policy solving nothing looks exactly like this: `learner 0.0s`,
accuracy 0.0% -> 0.0%, and before issue 80 not a word."""

from __future__ import annotations

import dataclasses
from typing import Any

from rstar2_jax.core.config_types import Section, setting


@dataclasses.dataclass(frozen=True)
class IdleConfig(Section):
    """`rl.idle.*`: what a run does about RL steps that train nothing."""
    warn_after: int = setting(3, "consecutive RL steps with no kept rollout (no update) before a warning names the "
                              "likely cause (0: never warn)", min=0)
    stop_after: int = setting(0, "consecutive such steps that stop the run with that cause (0: never stop)", min=0)


class RunNotLearning(RuntimeError):
    """rl.idle.stop_after steps in a row trained nothing (the message says why it is likely)."""


def likely_cause(metrics: dict[str, Any]) -> str:
    """Why a step's groups were all uniform, from its metrics (rollout/scoring.py METRICS)."""
    accuracy = metrics.get("accuracy", 0.0)
    if accuracy <= 0.0:
        formats = metrics.get("format_failure_rate")
        told = f", format failures {formats:.0%}" if formats is not None else ""
        return (f"no rollout solved its problem (accuracy 0%{told}): the policy is too weak for the data "
                "(a longer SFT: sft.steps; easier problems), the budget too short for an answer "
                "(stages[].max_response_tokens), or answers are read in another format than the model writes "
                "(data.answer_format)")
    if accuracy >= 1.0:
        return ("every rollout solved its problem (accuracy 100%): the data is too easy for the policy (harder "
                "problems; the stage's filter_solved_k drops the solved ones)")
    return (f"every group's rollouts scored alike (accuracy {accuracy:.0%}): each problem was solved by all of its "
            "rollouts or by none; more rollouts per problem (rl.group_size, rl.oversample) or a higher "
            "temperature (rollout.temperature) gives groups that differ")


@dataclasses.dataclass
class IdleWatch:
    """Counts consecutive steps that kept nothing; observe() returns a warning when due and raises
    RunNotLearning at the stop."""
    settings: IdleConfig
    idle: int = 0

    def observe(self, step: int, metrics: dict[str, Any]) -> str | None:
        if metrics.get("kept_rollouts", 0) > 0:
            self.idle = 0
            return None
        self.idle += 1
        first = step - self.idle + 1
        what = f"RL steps {first}-{step} kept no rollout and trained nothing: {likely_cause(metrics)}"
        if self.settings.stop_after and self.idle >= self.settings.stop_after:
            raise RunNotLearning(f"stopped: {what} (rl.idle.stop_after={self.settings.stop_after}; the run resumes "
                                 "from its last checkpoint)")
        if self.settings.warn_after and self.idle >= self.settings.warn_after and (
                self.idle - self.settings.warn_after) % self.settings.warn_after == 0:
            stop = (f"rl.idle.stop_after={self.settings.stop_after} stops the run" if self.settings.stop_after
                    else "rl.idle.stop_after=N stops a run after N such steps")
            return f"warning: {what}; {stop}"
        return None
