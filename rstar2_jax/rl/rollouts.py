"""The rollout producer: every path of the trainer gets its rollouts through it.

One object owns what a rollout needs in this process (the engine, the sandbox, the tokenizer, the
prompt format, the in-flight journal's directory) and what every path does alike: the sampling
seeds (derived from the run seed, the path and the rollout's place, so a resumed run draws the
same), this process's share of the rollouts (`processes.my_share`), the engine's per-owner
accounting, and the gather of every process's share. The trainer's paths are one call each:

    producer.rollouts(problems, k, agent, seeds)   the pre-filter, dynamic sampling's top-ups:
                                                   every process's share, gathered (a collective)
    producer.step_rollouts(step, problems, drawn)  a step's 2G rollouts, this process's share, as
                                                   the consumer receives them: run (`step`: journaled
                                                   turn by turn, the engine's work on them), or under
                                                   rl.staleness.policy=carry started as tasks
                                                   (`launch`; carry.py cuts them, and relaunches
                                                   carried groups at a resume)
    producer.everywhere(problems, agent, seeds)    evaluation: every rollout on every process
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Sequence

from rstar2_jax.core import processes
from rstar2_jax.rl.carry import RunningGroups
from rstar2_jax.rl.run_state import DataState
from rstar2_jax.rl.seeds import rollout_seed
from rstar2_jax.rl.step_rollouts import StepRollouts
from rstar2_jax.rollout import AgentConfig, PromptFormat
from rstar2_jax.rollout.engines import Engine
from rstar2_jax.rollout.engines.accounting import owned_by
from rstar2_jax.rollout.journal import StepJournal
from rstar2_jax.rewards import Grader
from rstar2_jax.rollout.scoring import Scored, rollout_problems, scored_rollout
from rstar2_jax.core.timeline import Timeline


class RolloutProducer:
    def __init__(self, cfg, engine: Engine, sandbox, tokenizer, fmt: PromptFormat, *, inflight_dir: str,
                 restored_version: int):
        """cfg: the RunConfig. restored_version: the weights version the session started from
        (journaled tokens of newer weights were lost with a crash: rollout/journal.py)."""
        self.cfg, self.engine, self.sandbox, self.tokenizer, self.fmt = cfg, engine, sandbox, tokenizer, fmt
        self.inflight_dir, self.restored_version = inflight_dir, restored_version
        self.grader = Grader(cfg.data.answer_format)  # the run's answer format, for training and evaluation

    @property
    def rollouts_per_problem(self) -> int:
        return self.cfg.rl.rollouts_per_problem

    def agent(self, step: int, temperature: float | None = None) -> AgentConfig:
        """The agent loop's settings at `step` (its stage's budget and turns)."""
        stage, r = self.cfg.stage(step), self.cfg.rollout
        return AgentConfig(format=self.fmt, max_turns=stage.max_turns, max_response_tokens=stage.max_response_tokens,
                           temperature=r.temperature if temperature is None else temperature,
                           tool_timeout_s=r.tool_timeout_s, tool_state=self.cfg.sandbox.tool_state)

    def seed(self, step: int, group: int, sample: int) -> int:
        """The sampling seed of rollout `sample` of the step's problem `group` (every process alike)."""
        return rollout_seed(self.cfg.seed, step, group, sample)

    def journal(self, step: int) -> StepJournal:
        return StepJournal(self.inflight_dir, step, max_version=self.restored_version)

    async def rollouts(self, problems, k: int, agent: AgentConfig, seeds: Sequence[int]) -> list[Scored]:
        """k rollouts of every problem (problem-major, rollout i seeded seeds[i]): this process
        runs its share and every process's are gathered, so every process returns all of them.
        A collective: the consumer's and the pre-filter's, never the producer's."""
        return processes.gather_shares(await self._my_share(problems, k, agent, seeds), len(problems) * k)

    async def step_rollouts(self, step: int, problems, drawn: DataState) -> StepRollouts:
        """Step `step`'s rollouts of `problems`, drawn from the data stream leaving it at `drawn`:
        run to the end, or started as tasks when rl.staleness.policy carries (the consumer cuts)."""
        out = self.launch(step, problems) if self.cfg.rl.staleness.carries else await self.step(step, problems)
        return dataclasses.replace(out, drawn=drawn)

    async def step(self, step: int, problems) -> StepRollouts:
        """This process's share of the step's 2G rollouts of every problem, concurrently, with the
        step's seeds; saved turn by turn (a run killed mid-step resumes them where they were); the
        engine's work on exactly these requests. The consumer gathers the shares."""
        n_roll = self.rollouts_per_problem
        seeds = [self.seed(step, b, j) for b in range(len(problems)) for j in range(n_roll)]
        start, timeline, owner = time.monotonic(), Timeline(), ("rollout", step)
        journal = self.journal(step)
        with timeline.activate(), owned_by(owner):  # the engine charges this step's requests to it
            scored = await self._my_share(problems, n_roll, self.agent(step), seeds, journal=journal)
        rollout_s = time.monotonic() - start - timeline.union("reward")
        work = self.engine.take_owned(owner)
        if work is not None:  # engines that account per owner (all of ours)
            timeline.extend("engine", work.busy)
        return StepRollouts(list(problems), scored, start, rollout_s, timeline, work, counts=journal.resumed_counts())

    def launch(self, step: int, problems, groups: Sequence[int] | None = None) -> StepRollouts:
        """rl.staleness.policy=carry: this process's share of the rollouts of `groups` (default: all)
        of the step's problems started as tasks, each graded as it ends; carry.cut decides what
        the step trains. Seeds, journal and owner are those `step` gives the same rollouts."""
        n_roll = self.rollouts_per_problem
        groups = list(range(len(problems))) if groups is None else list(groups)
        agent, timeline, journal = self.agent(step), Timeline(), self.journal(step)
        wanted = {b * n_roll + j for b in groups for j in range(n_roll)}
        tasks = {}
        with timeline.activate(), owned_by(("rollout", step)):  # the tasks inherit both
            for i in processes.my_share(len(problems) * n_roll):
                if i in wanted:
                    p, seed = problems[i // n_roll], self.seed(step, i // n_roll, i % n_roll)
                    tasks[i] = asyncio.ensure_future(scored_rollout(
                        self.engine, self.sandbox, self.tokenizer, p.question, p.answer, agent, seed,
                        grader=self.grader, journal=journal.rollout(i, p.question, seed, agent)))
        return StepRollouts(list(problems), [], time.monotonic(), 0.0, timeline, None,
                            running=RunningGroups(step, list(problems), groups, tasks, journal))

    async def everywhere(self, problems, agent: AgentConfig, seeds: Sequence[int], progress=None) -> list[Scored]:
        """One rollout of every problem on this process (each process runs them all: evaluation)."""
        return await rollout_problems(self.engine, self.sandbox, self.tokenizer, [p.question for p in problems],
                                      [p.answer for p in problems], agent, list(seeds), grader=self.grader,
                                      progress=progress)

    async def _my_share(self, problems, k: int, agent: AgentConfig, seeds: Sequence[int],
                        journal: StepJournal | None = None) -> list[Scored]:
        questions = [p.question for p in problems for _ in range(k)]
        golds = [p.answer for p in problems for _ in range(k)]
        mine = processes.my_share(len(questions))
        return await rollout_problems(self.engine, self.sandbox, self.tokenizer, [questions[i] for i in mine],
                                      [golds[i] for i in mine], agent, [seeds[i] for i in mine], grader=self.grader,
                                      journal=journal, indices=list(mine))

