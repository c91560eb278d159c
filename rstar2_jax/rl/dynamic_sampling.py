"""DAPO's dynamic sampling: draw more problems until the step has `rl.batch_problems` groups
whose rollouts disagree (DAPO, arXiv 2503.14476, section 3.2: groups of all-correct or
all-wrong rollouts have zero advantage and teach nothing).

Where it runs: in the consumer, after the step's own rollouts are gathered, so every process
sees the same groups and decides the same; the extra problems come from a second shuffled
stream of the training problems that only the consumer advances, in step order (DataStream.
draw_topup), so every process and every rerun draws the same extra problems, and the
producer (which may be drawing later steps meanwhile) issues no collective. Each round draws
the shortfall divided by the informative share seen so far (at least 10%), bounded by
`max_problems` problems per step in all; a step that stays short trains on what it has. Extra
informative groups beyond the batch are not trained on (DAPO truncates the same way).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from rstar2_jax.algo import group_is_informative
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.rl.seeds import topup_seeds


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig(Section):
    """`rl.dynamic_sampling.*`: DAPO's draw-until-informative (off: the paper)."""
    enabled: bool = setting(False, "draw more problems until the step has rl.batch_problems groups with "
                            "differing rewards")
    max_problems: int = setting(0, "problems drawn per step at most, the first batch included (0: 4 x "
                                "rl.batch_problems)", min=0)

    def bound(self, batch_problems: int) -> int:
        return self.max_problems or 4 * batch_problems


def informative_groups(rewards: Sequence[float], n_roll: int) -> int:
    """Groups (n_roll consecutive rewards each) whose rewards are not all equal."""
    return sum(group_is_informative(rewards[i:i + n_roll]) for i in range(0, len(rewards), n_roll))


def next_draw(informative: int, drawn: int, wanted: int, bound: int) -> int:
    """How many problems the next round draws: the shortfall over the informative share so far
    (at least 10%), never past the bound; 0 when the step is full or the bound is reached."""
    if informative >= wanted or drawn >= bound:
        return 0
    share = max(informative / max(drawn, 1), 0.1)
    return int(min(math.ceil((wanted - informative) / share), bound - drawn))


def fill_summary(informative: int, wanted: int, drawn: int, rounds: int) -> dict[str, float]:
    return {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/problems_drawn": float(drawn),
            "dynamic_sampling/informative_groups": float(informative),
            "dynamic_sampling/filled": float(np.clip(informative / max(wanted, 1), 0.0, 1.0))}


async def fill(out, producer, stream, step: int, cfg) -> tuple[Any, dict[str, float]]:
    """Rounds of extra problems (`stream.draw_topup`), rolled out by the rollout producer with the
    current weights and gathered, after those of `out` (a step's StepRollouts, gathered) until
    they hold rl.batch_problems groups with differing rewards or the draw bound is reached:
    returns the step's rollouts with them, and the fill metrics. Runs in the consumer
    (collectives allowed), the same in every process."""
    n_roll = cfg.rl.rollouts_per_problem
    wanted, bound = cfg.rl.batch_problems, cfg.rl.dynamic_sampling.bound(cfg.rl.batch_problems)
    informative, rounds = informative_groups([s.reward for s in out.scored], n_roll), 0
    problems_in, scored_in = list(out.problems), list(out.scored)
    with out.timeline.span("dynamic_sampling"):
        while count := next_draw(informative, len(problems_in), wanted, bound):
            rounds += 1
            problems = stream.draw_topup(step, count)
            seeds = topup_seeds(cfg.seed, step, rounds, len(problems), n_roll)
            scored = await producer.rollouts(problems, n_roll, producer.agent(step), seeds)
            informative += informative_groups([s.reward for s in scored], n_roll)
            problems_in += problems
            scored_in += scored
    return (dataclasses.replace(out, problems=problems_in, scored=scored_in),
            {**fill_summary(informative, wanted, len(problems_in), rounds),
             "time/dynamic_sampling_s": out.timeline.union("dynamic_sampling")})
