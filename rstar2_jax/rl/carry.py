"""Staleness policies: what a step does about its slowest groups (`rl.staleness.*`).

    wait   (default) a step trains once all its groups are in. The bound rl.max_staleness = k
           holds by pausing admission: step s's rollouts start only after step s-1-k is trained
           (pipeline.py), so nothing is dropped and nothing expires; a long rollout delays the
           update instead.
    carry  a step trains once `carry_fraction` of its groups are in; the others keep running and
           join the next step's batch, which waits for them (a group is carried once). Their
           tokens may then lag k + 1 versions: they are kept and corrected (rl.correction), never
           dropped; `staleness/over_bound_tokens` counts them.

Frameworks that bound staleness by dropping expired groups drop the long ones, which are then
trained on less; neither policy here drops a group (tested on short and long groups alike).

Groups straddle processes (process p runs rollouts p, p+P, ...), so whether a group is complete
is decided on gathered flags, in the consumer: every process gathers the same flags in the same
order and reaches the same decision.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

from rstar2_jax.core import processes
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.rl.run_state import CarriedGroups
from rstar2_jax.rollout.engines.accounting import merge_work

POLICIES = ("wait", "carry")


@dataclasses.dataclass(frozen=True)
class StalenessConfig(Section):
    """`rl.staleness.*`: what a step does about groups still running when most are in."""
    policy: str = setting("wait", "wait: a step trains when all its groups are in (admission paused: the bound "
                          "holds, nothing dropped); carry: it trains once carry_fraction of them are in and the "
                          "rest join the next step (kept and corrected, never dropped)", choices=POLICIES)
    carry_fraction: float = setting(0.75, "policy=carry: share of a step's groups that must be in before it trains",
                                    min=0.0, max=1.0)

    def rules(self):
        if self.carry_fraction <= 0:
            yield "carry_fraction", f"must be > 0 (a step needs groups to train on), got {self.carry_fraction}"

    @property
    def carries(self) -> bool:
        return self.policy == "carry"

    def wanted(self, groups: int) -> int:
        """Groups a step waits for before it trains."""
        return max(1, math.ceil(self.carry_fraction * groups)) if self.carries else groups


@dataclasses.dataclass
class RunningGroups:
    """Some groups of one step, their rollouts running in this process as tasks."""
    step: int
    problems: list                  # every problem of the step, group order (b)
    groups: list[int]               # the groups (indices into problems) still to be trained
    tasks: dict[int, asyncio.Task]  # rollout index in the step (b x n + j) -> this process's task
    journal: Any = None             # rollout/journal.StepJournal the tasks save to (what they resumed)

    def rollouts(self, n_roll: int) -> int:
        return len(self.problems) * n_roll


def complete_groups(flags: list, groups: list[int], n_roll: int) -> list[int]:
    """The groups all of whose rollouts are done (flags: one per rollout of the step, or None for
    a rollout that is not running)."""
    return [b for b in groups if all(flags[b * n_roll + j] for j in range(n_roll))]


def _local(tasks: dict[int, asyncio.Task], n: int, value, only: set[int] | None = None) -> list:
    """This process's share of a per-rollout list (processes.my_share order): value(task) for its
    running rollouts (those in `only`, when given), None elsewhere."""
    return [value(tasks[i]) if i in tasks and (only is None or i in only) else None for i in processes.my_share(n)]


async def wait_for_groups(running: RunningGroups, n_roll: int, want: int, poll_s: float = 0.05) -> list[int]:
    """Waits until at least `want` of the running groups are complete in every process (a
    collective per poll: all processes call it together, in the consumer); returns them."""
    n = running.rollouts(n_roll)
    want = min(want, len(running.groups))
    while True:
        flags = processes.gather_shares(_local(running.tasks, n, lambda t: t.done()), n)
        done = complete_groups(flags, running.groups, n_roll)
        if len(done) >= want:
            return done
        await asyncio.sleep(poll_s)


def gather_groups(running: RunningGroups, groups: list[int], n_roll: int) -> list[Any]:
    """The results of `groups` (complete everywhere: wait_for_groups), problem-major, from every
    process (a collective)."""
    n = running.rollouts(n_roll)
    wanted = {b * n_roll + j for b in groups for j in range(n_roll)}
    everyone = processes.gather_shares(_local(running.tasks, n, lambda t: t.result(), only=wanted), n)
    return [everyone[b * n_roll + j] for b in groups for j in range(n_roll)]


async def gathered(out, carried_in: RunningGroups | None, engine, *, n_roll: int, staleness: StalenessConfig,
                   last: bool) -> tuple[Any, RunningGroups | None]:
    """In the consumer (a collective, every process in step order): the step's rollouts of every
    process, and the groups carried out of it. The one gather of a step: a step run to its end
    gathers every rollout; a launched one (rl.staleness.policy=carry) is cut (`cut`)."""
    if out.running is None:
        return dataclasses.replace(out, scored=processes.gather_shares(out.scored, len(out.problems) * n_roll)), None
    return await cut(out, carried_in, engine, n_roll=n_roll, staleness=staleness, last=last)


async def cut(out, carried_in: RunningGroups | None, engine, *, n_roll: int, staleness: StalenessConfig,
              last: bool) -> tuple[Any, RunningGroups | None]:
    """In the consumer (collectives): the step of `out` (launched: out.running) is cut once
    staleness.wanted of its groups are in (all of them at the run's last step), and the groups
    carried into it are waited for whole. Returns what the step trains (`out` with every
    process's results gathered, and the engine's work on them) and the groups carried out of it."""
    running = out.running
    # the cut first: what the step trains of its own is decided when enough of it is in, not
    # after waiting on the groups carried into it (by then all of it would be)
    done = await wait_for_groups(running, n_roll, want=len(running.groups) if last else
                                 staleness.wanted(len(running.groups)))
    problems, scored, work = [], [], None
    if carried_in is not None:
        await wait_for_groups(carried_in, n_roll, want=len(carried_in.groups))
        problems += [carried_in.problems[b] for b in carried_in.groups]
        scored += gather_groups(carried_in, carried_in.groups, n_roll)
        work = engine.take_owned(("rollout", carried_in.step))
    problems += [running.problems[b] for b in done]
    scored += gather_groups(running, done, n_roll)
    left = [b for b in running.groups if b not in done]
    work = merge_work([work, engine.take_owned(("rollout", running.step))])
    if work is not None:
        out.timeline.extend("engine", work.busy)
    counts = {**out.counts, **running.journal.resumed_counts(),
              "staleness/carried_in": len(carried_in.groups) if carried_in else 0, "staleness/carried_out": len(left)}
    cut_out = dataclasses.replace(out, problems=problems, scored=scored, work=work,
                                  rollout_s=time.monotonic() - out.started, counts=counts)
    return cut_out, (dataclasses.replace(running, groups=left) if left else None)


def relaunch(carried: CarriedGroups | None, producer, problems) -> RunningGroups | None:
    """After a restart: the groups a checkpoint says were carried, started again through the
    rollout producer (their journals resume them where they were) for the next step to train."""
    if carried is None:
        return None
    by_id = {p.id: p for p in problems}
    return producer.launch(carried.step, [by_id[i] for i in carried.problem_ids], carried.groups).running


def carried_state(carried: RunningGroups | None) -> CarriedGroups | None:
    """What a checkpoint records of the groups carried into the next step."""
    return None if carried is None else CarriedGroups(carried.step, tuple(p.id for p in carried.problems),
                                                      tuple(carried.groups))
