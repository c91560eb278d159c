"""What one RL step generated, as the consumer receives it from the producer."""

from __future__ import annotations

import dataclasses
from typing import Any

from rstar2_jax.rl.run_state import DataState
from rstar2_jax.rollout.scoring import Scored
from rstar2_jax.core.timeline import Timeline


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """The problems, this process's share of their 2G rollouts each (problem-major; every
    process's once the consumer gathered them), timings and the data stream as of the draw."""
    problems: list
    scored: list[Scored]
    started: float                 # time.monotonic() when the step's rollouts began
    rollout_s: float
    timeline: Timeline             # tool, reward, engine spans (and learner, sync once trained)
    work: Any                      # engines/accounting.OwnedWork: the engine's work on this step's requests
    drawn: DataState = DataState()  # the data stream right after this step's draw
    counts: dict = dataclasses.field(default_factory=dict)  # step figures: resumed from the journal, carried
    running: Any = None            # rl.staleness.policy=carry: carry.RunningGroups of the step (consume cuts it)
