"""The RL run: SFT warm start (optional), then GRPO-RoC steps.

Every step: next problems of the task -> 2G rollouts each (agent loop, engine, sandbox) ->
rewards and RoC penalties -> RoC keeps G -> advantages -> learner update (old log-probs
recomputed) -> weights to the engine -> traces (Parquet), metrics (JSONL + TensorBoard),
checkpoint (orbax).

The trainer is generic: the task (`data.task`, rstar2_jax.data.tasks), the model
(`models.resolve`) and the engine (`make_engine`) come from the config by name. It wires parts
that each own one job: the run's typed state (run_state.py), the data stream and its filters
(data_stream.py), the staleness-gated producer/consumer loop (pipeline.py), RoC selection
(grpo_roc.py), the learner, and the step's metrics and logs (step_metrics.py).

Reproducible: every rollout's sampling seed, every RoC draw and the per-epoch data order derive
from (config seed, step, problem, sample), so a run resumed from its last checkpoint continues
exactly as it would have.

Asynchronous rollouts (`rl.max_staleness` = k > 0): a producer generates the steps' rollouts in
order while the learner trains on earlier ones; step s's rollouts start once the learner has
finished step s - 1 - k, so no trained token was sampled by weights more than k versions behind the
learner (checked per token at training time). Weights sync to the engine after every update and
reach rollouts in flight between decode steps (partial rollouts). With k = 0 the producer waits
for every update: the on-policy loop of the paper, step for step. Async runs depend on timing
(which tokens a sync reaches), so they resume from their checkpoints with the same data and
seeds but are not bit-for-bit repeatable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

from rstar2_jax import models, sharding
from rstar2_jax.checkpoints import RunCheckpoints
from rstar2_jax.config_types import ConfigValueError
from rstar2_jax.data.tasks import make_task
from rstar2_jax.learner import Learner, make_batch
from rstar2_jax.learner.sft import SFTTrainer, iterate_batches
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.models.tokenizer import Tokenizer
from rstar2_jax import processes
from rstar2_jax.rl.config import RunConfig, StageConfig
from rstar2_jax.rl.dynamic_sampling import fill_summary, informative_groups, next_draw
from rstar2_jax.rl.data_stream import DataStream, solved_ids
from rstar2_jax.rl.grpo_roc import KeptRollout, advantages_with_kl, select_step
from rstar2_jax.rl.pipeline import run_pipeline, token_staleness
from rstar2_jax.rl.prefilter import prefilter_solved
from rstar2_jax.rl.run_dir import RunDirectory
from rstar2_jax.rl.carry import RunningGroups, gather_groups, wait_for_groups
from rstar2_jax.rl.run_state import CarriedGroups, DataState, RunState
from rstar2_jax.rl.step_metrics import MetricsLog, format_breakdown, format_results, step_metrics
from rstar2_jax.rl.step_rollouts import StepRollouts
from rstar2_jax.rollout import AgentConfig, PromptFormat, make_format
from rstar2_jax.rollout.engines import Engine, engine_kind, engine_mesh, make_engine
from rstar2_jax.rollout import journal
from rstar2_jax.rollout.engines.accounting import merge_work, owned_by
from rstar2_jax.rollout.journal import StepJournal
from rstar2_jax.rollout.sandboxes import make_sandbox
from rstar2_jax.rollout.scoring import Scored, rollout_problems, scored_rollout, stable_seed, summarize
from rstar2_jax.timeline import Timeline
from rstar2_jax.traces import TraceWriter

__all__ = ["ConfigValueError", "RLRun", "RunConfig", "run", "validate"]


def validate(cfg: ml_collections.ConfigDict | RunConfig, processes_count: int | None = None) -> RunConfig:
    """The run's typed config, every field checked (against `processes_count` trainer processes,
    default: this job's) before anything runs; ConfigValueError lists every problem."""
    if isinstance(cfg, RunConfig):
        cfg = cfg.to_dict()
    return RunConfig.from_config(cfg, jax.process_count() if processes_count is None else processes_count)


def check_prompt_room(fmt: PromptFormat, tokenizer, problems, stages: Sequence[StageConfig], max_len: int):
    """The longest prompt of `problems` plus every stage's response budget must fit max_len."""
    longest = max(len(tokenizer.encode(fmt.prompt(p.question))) for p in problems)
    for i, stage in enumerate(stages):
        if longest + stage.max_response_tokens > max_len:
            raise ConfigValueError([f"the longest prompt ({longest} tokens) + stages[{i}].max_response_tokens "
                                    f"({stage.max_response_tokens}) exceeds rollout.max_len ({max_len})"])


class RLRun:
    def __init__(self, cfg: ml_collections.ConfigDict | RunConfig, workdir: str, *, config_mismatch: str = "stop"):
        """`config_mismatch`: what a config that differs from the run directory's config.json does
        ("stop": ConfigMismatchError naming the keys; "ok": the change goes into the run's config
        history). Extending rl.steps and the like never stops (run_dir.RESUMABLE_CHANGES)."""
        cfg = validate(cfg)
        self.cfg, self.workdir = cfg, os.path.abspath(workdir)
        self.run_dir = RunDirectory(self.workdir)
        self.fmt = make_format(cfg.format)
        if processes.is_primary():  # the others read what it wrote (one run directory)
            self.run_dir.record_config(cfg.to_dict(), config_mismatch)
            self.model_dir = models.resolve(cfg.model, self.workdir, seed=cfg.seed)
            self.run_dir.write_run_info({"model_dir": os.path.abspath(self.model_dir), "run_name": cfg.run_name,
                                         "format": cfg.format})
        processes.barrier("run directory written")
        if not processes.is_primary():
            self.model_dir = models.resolve(cfg.model, self.workdir, seed=cfg.seed)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.task = make_task(cfg.data, cfg.seed)
        check_prompt_room(self.fmt, self.tokenizer, [*self.task.train_problems, *self.task.eval_problems],
                          cfg.stages, cfg.rollout.max_len)
        # The mesh exists before the weights: each tensor streams from its safetensors file straight
        # onto its shards (one host tensor at a time), and the learner then owns those arrays.
        self.mesh = sharding.make_mesh(**cfg.mesh.axes()) if jax.device_count() > 1 else None
        self.model = models.load_pretrained(self.model_dir, dtype=DTYPES[cfg.model.dtype], param_dtype=jnp.float32,
                                            mesh=self.mesh)
        self.model.remat = cfg.model.remat
        self.model.set_attention(full=cfg.model.attention, decode=cfg.model.decode_attention)
        self.checkpoints = RunCheckpoints(os.path.join(self.workdir, "checkpoints"), keep=cfg.checkpoint.keep)
        self.traces = TraceWriter(os.path.join(self.workdir, "traces"))
        self.log = MetricsLog(self.workdir, cfg.logging, cfg.run_name, cfg.to_dict())
        self.learner: Learner | None = None
        self.data: DataStream | None = None  # the training problems' stream (train_steps)
        self.sandbox = None  # the session's sandbox
        self._evaluated = False  # an evaluation ran in this call of run()
        self.inflight_dir = os.path.join(self.workdir, "inflight")  # in-flight rollouts (rollout/journal.py)
        self.restored_version = 0  # weights version the session started from (the checkpoint's)
        self.carried: RunningGroups | None = None  # rl.staleness.policy=carry: groups the next step trains

    @property
    def train_problems(self):
        return self.task.train_problems

    @property
    def eval_problems(self):
        return self.task.eval_problems

    @property
    def rollouts_per_problem(self) -> int:
        return self.cfg.rl.rollouts_per_problem

    # ------------------------------------------------------------------------------------------
    def agent_config(self, step: int, temperature: float | None = None) -> AgentConfig:
        stage = self.cfg.stage(step)
        r = self.cfg.rollout
        return AgentConfig(format=self.fmt, max_turns=stage.max_turns, max_response_tokens=stage.max_response_tokens,
                           temperature=r.temperature if temperature is None else temperature, tool_timeout_s=r.tool_timeout_s,
                           tool_state=self.cfg.sandbox.tool_state)

    def make_engine(self, engine_model) -> Engine:
        return make_engine(self.cfg.rollout, engine_model, self.tokenizer, seed=self.cfg.seed)

    def sft(self):
        c = self.cfg.sft
        data = self.task.sft_data(self.tokenizer, self.fmt, c.examples, seed=self.cfg.seed + 2)
        trainer = SFTTrainer(self.model, lr=c.lr, warmup_steps=c.warmup_steps, pad_multiple=32)
        bar = tqdm(zip(range(c.steps), iterate_batches(data, c.batch_size, self.cfg.seed)), total=c.steps,
                   desc="SFT", dynamic_ncols=True)
        for i, batch in bar:
            m = trainer.step(batch)
            bar.set_postfix(loss=f"{m['loss']:.3f}")
            self.log.write({"phase": "sft", "step": i, **m})
        return trainer.params()

    async def evaluate(self, engine, sb, step: int, label: str) -> dict[str, Any]:
        probs = self.eval_problems
        out = {}
        for name, temperature in (("greedy", 0.0), ("sampled", self.cfg.rollout.temperature)):
            seeds = [stable_seed(self.cfg.seed, label, name, i) for i in range(len(probs))]
            with tqdm(total=len(probs), desc=f"eval {label} ({name})", dynamic_ncols=True, leave=False,
                      disable=not processes.is_primary()) as bar:
                scored = await rollout_problems(engine, sb, self.tokenizer, [p.question for p in probs],
                                                [p.answer for p in probs], self.agent_config(step, temperature), seeds,
                                                progress=bar)
            out[name] = summarize(scored)
        self._evaluated = True
        self.log.write({"phase": "eval", "label": label, "step": step, **{f"{k}/{m}": v for k, s in out.items()
                                                                          for m, v in s.items()}})
        return out

    # ------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Evaluate before RL, train to rl.steps, evaluate after; a re-run of a finished run
        reports its results without evaluating again."""
        cfg = self.cfg
        try:
            async with self.session() as (engine, sb, state):
                results = dict(state.results)
                finished = self.run_dir.load_results()
                if state.rl_step >= cfg.rl.steps and "after" in finished:  # evaluated at this step already
                    results["after"] = finished["after"]
                if cfg.eval.before_and_after and "before" not in results:
                    results["before"] = await self.evaluate(engine, sb, state.rl_step, "before_rl")
                    self.state = dataclasses.replace(self.state, results=results)
                await self.train_steps(engine, sb)
                if cfg.eval.before_and_after and "after" not in results:
                    results["after"] = await self.evaluate(engine, sb, cfg.rl.steps, "after_rl")
            if processes.is_primary():
                self.run_dir.save_results(results)
                if self._evaluated:  # the before/after table as text, once per evaluation that ran
                    self.log.text(
                        "results", "\n".join("    " + line for line in format_results(results).splitlines()),
                        cfg.rl.steps)
        finally:
            self.log.close()
        return results

    @contextlib.asynccontextmanager
    async def session(self):
        """The learner (resumed from the last checkpoint, or after SFT), the sandbox and the engine
        holding the learner's weights; yields (engine, sandbox, run state). The run state is
        `self.state` (a new value after every trained step)."""
        cfg = self.cfg
        latest = self.checkpoints.latest_step()
        self.state = RunState()
        warm_start = latest is None and cfg.sft.steps > 0
        # The learner owns the loaded (or SFT'd) arrays: no second copy of the model. From its first
        # update on, self.model serves only as the architecture (model_with).
        start_model = self.model_with(self.sft()) if warm_start else self.model
        self.learner = Learner(start_model, cfg.rl, temperature=cfg.rollout.temperature,
                               constant_tokens=cfg.constant_tokens, mesh=self.mesh, own_params=True)
        if latest is not None:
            self.learner.state, raw = self.checkpoints.restore(latest, self.learner.state)
            self.state = RunState.from_json(raw, f"{self.checkpoints.directory} step {latest}")
            self.learner.version = self.state.version
            if self.learner.ref_params is not None:
                self.learner.ref_params = self.checkpoints.restore_reference(latest, self.learner.ref_params)
            print(f"resumed from {self.checkpoints.directory} step {latest}")
        elif warm_start:
            self.save_checkpoint(0)
        # saved in-flight tokens of weights newer than these were lost with the crash (journal.py)
        self.restored_version = self.learner.version
        weights = self.engine_weights()  # one copy (or gather) for the engine's model and its version
        try:
            async with make_sandbox(cfg.sandbox) as sb, \
                    self.make_engine(self.model_with(weights)) as engine:
                await engine.sync(weights, self.learner.version)
                self.sandbox = sb  # dynamic sampling's extra rollouts (consume)
                yield engine, sb, self.state
        finally:
            self.checkpoints.close()

    def save_checkpoint(self, step: int):
        self.checkpoints.save(step, self.learner.state, self.state.to_json(), reference=self.learner.ref_params)
        if processes.is_primary():  # the in-flight rollouts of trained steps are in the checkpoint now
            carried = self.state.carried  # ... except a carried group's, trained at the next step
            journal.prune(self.inflight_dir, step if carried is None else min(step, carried.step))

    async def train_steps(self, engine: Engine, sb):
        """RL steps from the run state's rl_step to rl.steps through the pipeline: a producer
        draws each step's problems and starts its rollouts (at most rl.max_staleness steps ahead
        of the learner); the consumer trains on them in order, logs and checkpoints."""
        cfg = self.cfg
        start = self.state.rl_step
        self.data = self.data_stream()
        bar = tqdm(range(start, cfg.rl.steps), initial=start, total=cfg.rl.steps, desc="GRPO-RoC", dynamic_ncols=True)
        last_end = time.monotonic()

        async def draw(step: int):
            return self.roll_out(engine, sb, step, *await self.draw(engine, sb, step))

        self.carried = self.relaunch_carried(engine, sb)  # groups a checkpoint says were carried

        async def consume(step: int, out: StepRollouts):
            nonlocal last_end
            metrics = await self.consume(engine, step, out)
            metrics["time/interval_s"] = time.monotonic() - last_end  # wall time per step, overlap included
            last_end = time.monotonic()
            self.log.write(metrics)
            bar.update(1)
            bar.write(format_breakdown(metrics))
            bar.set_postfix(acc=f"{metrics['accuracy']:.2f}", p_err=f"{metrics['tool_error_ratio_correct']:.2f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
            if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.rl.steps:
                self.save_checkpoint(step + 1)

        try:
            # An offline pre-filter samples with the previous stage's final policy, and its
            # rollouts are gathered: every earlier step is trained first (an exclusive draw).
            await run_pipeline(range(start, cfg.rl.steps), max_lag=cfg.rl.max_staleness, draw=draw, consume=consume,
                               exclusive=self.data.prefilter_begins)
        finally:
            bar.close()

    def engine_weights(self):
        """The learner's parameters as this process's engine holds them (the engine's kind says
        how: rollout/engines/factory.EngineWeights): the learner's own arrays where that is safe
        (a served engine's sync streams them; float32 on one device, on-policy), else a copy in the
        engine's dtype, split over its devices (`engine_mesh`). The learner's update donates its
        buffers, so anything the engine keeps across an update is a copy."""
        params = self.learner.model_state()
        how = engine_kind(self.cfg.rollout).weights(self.cfg.rollout, self.cfg.model.dtype)
        if how.shares(learner_devices=jax.device_count(), on_policy=self.cfg.rl.max_staleness == 0):
            return params
        mesh = engine_mesh(self.cfg.model.decode_attention) if how.split else None
        return processes.local_copy(params, DTYPES[how.dtype] if how.dtype else None,
                                    sharding.param_shardings(params, mesh) if mesh else None)

    def model_with(self, params):
        """The run's model architecture with `params` (an nnx.State of its Params)."""
        from flax import nnx
        graphdef, _ = nnx.split(self.model, nnx.Param)
        return nnx.merge(graphdef, params)

    # ------------------------------------------------------------------------------------------
    # one RL step: rollouts (produce) -> selection -> training -> metrics (consume)
    async def produce(self, engine: Engine, sb, step: int) -> StepRollouts:
        """Step `step`'s problems from the data stream and this process's share of their rollouts
        (the sequential loop: what the pipeline does with max_staleness 0)."""
        return await self.roll_out(engine, sb, step, *await self.draw(engine, sb, step))

    def data_stream(self) -> DataStream:
        """The training problems' stream as the run state left it (a fresh run: from the start)."""
        return DataStream(self.train_problems, self.cfg, self.state.data, self.state.rl_step)

    async def draw(self, engine: Engine, sb, step: int) -> tuple[list, DataState]:
        """Step `step`'s problems and the data stream's state after the draw (the stage's
        pre-filter first, when it begins). The stream starts where the run state left it."""
        if self.data is None:
            self.data = self.data_stream()
        return await self.data.draw(step, lambda stage_i, s: self.prefilter(engine, sb, stage_i, s))

    async def roll_out(self, engine: Engine, sb, step: int, problems, drawn: DataState) -> StepRollouts:
        """This process's share of the step's rollouts (all of them with one process); with
        rl.staleness.policy=carry, started as tasks that the consumer cuts (cut)."""
        if self.cfg.rl.staleness.carries:
            out = self.launch(engine, sb, step, problems)
            out.drawn = drawn
            return out
        out = await self.generate(engine, sb, step, problems)
        out.drawn = drawn
        return out

    async def consume(self, engine: Engine, step: int, out: StepRollouts) -> dict[str, Any]:
        """Every process's rollouts of the step gathered (a collective: called in step order, never
        beside an update), the stage's problem filter, RoC selection, the update (weights then go
        to the engine) and the step's traces; advances the run state; returns the step's metrics."""
        cfg = self.cfg
        if out.running is not None:  # rl.staleness.policy=carry: the step is cut here (collectives)
            await self.cut(engine, step, out)
        else:
            out.scored = processes.gather_shares(out.scored, len(out.problems) * self.rollouts_per_problem)
        sampling = (await self.fill_informative(engine, self.sandbox, step, out) if cfg.rl.dynamic_sampling.enabled
                    else {})
        stage = cfg.stage(step)
        solved_now = (solved_ids(out.problems, [s.reward for s in out.scored], self.rollouts_per_problem,
                                 stage.filter_solved_k) if stage.filter_solved_k else set())
        data = self.data.after_training(step, out.drawn, solved_now)
        stage_i = cfg.stage_index(step)
        if stage_i != self.state.stage and cfg.stages[stage_i].reset_optimizer:
            self.learner.reset_optimizer()
        staleness = token_staleness([s.trajectory.versions for s in out.scored],
                                    [s.trajectory.kv_versions for s in out.scored], self.learner.version,
                                    cfg.rl.max_staleness, step, carried=int(cfg.rl.staleness.carries))
        kept, records = select_step(cfg, step, out.problems, out.scored,
                                    max_groups=cfg.rl.batch_problems if sampling else None)
        train_metrics = await self.train(engine, kept, records, out.timeline)
        if processes.is_primary():
            self.traces.write(step, records)  # after the update: a crash before it redoes the step anyway
        carried = None if self.carried is None else CarriedGroups(
            self.carried.step, tuple(p.id for p in self.carried.problems), tuple(self.carried.groups))
        self.state = dataclasses.replace(self.state, rl_step=step + 1, version=self.learner.version, stage=stage_i,
                                         data=data, carried=carried)
        return {"phase": "rl", "step": step, "stage": stage_i,
                **step_metrics(engine, out, len(kept)), **staleness, **sampling, **train_metrics, **out.counts}

    async def fill_informative(self, engine: Engine, sb, step: int, out: StepRollouts) -> dict[str, float]:
        """DAPO's dynamic sampling (rl/dynamic_sampling.py): rounds of extra problems, rolled out
        with the current weights and gathered, appended to `out` until it holds rl.batch_problems
        groups with differing rewards or the draw bound is reached; returns the fill metrics.
        Runs in the consumer (collectives allowed), the same in every process."""
        cfg, n_roll = self.cfg, self.rollouts_per_problem
        wanted, bound = cfg.rl.batch_problems, cfg.rl.dynamic_sampling.bound(cfg.rl.batch_problems)
        informative, rounds = informative_groups([s.reward for s in out.scored], n_roll), 0
        with out.timeline.span("dynamic_sampling"):
            while count := next_draw(informative, len(out.problems), wanted, bound):
                rounds += 1
                problems = self.data.draw_topup(step, count)
                seeds = [stable_seed(cfg.seed, "topup", step, rounds, b, j) for b in range(len(problems))
                         for j in range(n_roll)]
                scored = await self.my_rollouts(engine, sb, problems, n_roll, self.agent_config(step), seeds)
                scored = processes.gather_shares(scored, len(seeds))
                informative += informative_groups([s.reward for s in scored], n_roll)
                out.problems += problems
                out.scored += scored
        return {**fill_summary(informative, wanted, len(out.problems), rounds),
                "time/dynamic_sampling_s": out.timeline.union("dynamic_sampling")}

    async def prefilter(self, engine: Engine, sb, stage_i: int, step: int) -> set[str]:
        """The paper's pre-pass before stage `stage_i`: filter_solved_k rollouts of every training
        problem with the current policy; the ids solved k/k (dropped for the rest of the run)."""
        cfg = self.cfg
        agent = self.agent_config(step)

        async def solve(problems, k):
            seeds = [stable_seed(cfg.seed, "prefilter", stage_i, p.id, j) for p in problems for j in range(k)]
            scored = await self.my_rollouts(engine, sb, problems, k, agent, seeds)
            rewards = processes.gather_shares([s.reward for s in scored], len(seeds))
            return [sum(r > 0 for r in rewards[i * k:(i + 1) * k]) for i in range(len(problems))]

        path = os.path.join(self.workdir, "prefilter", f"stage{stage_i}.jsonl")
        solved = await prefilter_solved(self.train_problems, cfg.stages[stage_i].filter_solved_k, path, solve,
                                        chunk=cfg.rl.batch_problems, desc=f"stage {stage_i} pre-filter",
                                        write=processes.is_primary())
        n = len(self.train_problems)
        print(f"stage {stage_i} pre-filter: {len(solved)} of {n} problems solved k/k and dropped, {n - len(solved)} kept")
        self.log.write({"phase": "prefilter", "stage": stage_i, "step": step, "problems": n, "dropped": len(solved)})
        return solved

    async def generate(self, engine: Engine, sb, step: int, problems) -> StepRollouts:
        """This process's share of the 2G rollouts of every problem, concurrently, with the step's
        seeds (the trainer gathers the shares: consume)."""
        n_roll = self.rollouts_per_problem
        seeds = [self.rollout_seed(step, b, j) for b in range(len(problems)) for j in range(n_roll)]
        start = time.monotonic()
        timeline = Timeline()
        owner = ("rollout", step)
        # saved turn by turn: a run killed mid-step resumes these rollouts where they were
        journal = StepJournal(self.inflight_dir, step, max_version=self.restored_version)
        with timeline.activate(), owned_by(owner):  # the engine charges this step's requests to it
            scored = await self.my_rollouts(engine, sb, problems, n_roll, self.agent_config(step), seeds,
                                            journal=journal)
        rollout_s = time.monotonic() - start - timeline.union("reward")
        work = engine.take_owned(owner)
        if work is not None:  # engines that account per owner (all of ours)
            timeline.extend("engine", work.busy)  # the engine's work on this step's own requests
        return StepRollouts(list(problems), scored, start, rollout_s, timeline, work, counts=resumed_counts(journal))

    def launch(self, engine: Engine, sb, step: int, problems, groups: Sequence[int] | None = None) -> StepRollouts:
        """rl.staleness.policy=carry: this process's share of the rollouts of `groups` (default:
        all) of the step's problems started as tasks, each graded as it ends; the consumer cuts
        the step (cut). Seeds, journal and owner are those generate gives the same rollouts."""
        n_roll = self.rollouts_per_problem
        groups = list(range(len(problems))) if groups is None else list(groups)
        agent, timeline = self.agent_config(step), Timeline()
        journal = StepJournal(self.inflight_dir, step, max_version=self.restored_version)
        wanted = {b * n_roll + j for b in groups for j in range(n_roll)}
        tasks = {}
        with timeline.activate(), owned_by(("rollout", step)):  # the tasks inherit both
            for i in processes.my_share(len(problems) * n_roll):
                if i in wanted:
                    p, seed = problems[i // n_roll], self.rollout_seed(step, i // n_roll, i % n_roll)
                    tasks[i] = asyncio.ensure_future(scored_rollout(
                        engine, sb, self.tokenizer, p.question, p.answer, agent, seed,
                        journal=journal.rollout(i, p.question, seed, agent)))
        return StepRollouts(list(problems), [], time.monotonic(), 0.0, timeline, None,
                            running=RunningGroups(step, list(problems), groups, tasks, journal))

    def rollout_seed(self, step: int, group: int, sample: int) -> int:
        """The sampling seed of rollout `sample` of the step's problem `group` (every process alike)."""
        return stable_seed(self.cfg.seed, "rollout", step, group, sample)

    async def cut(self, engine: Engine, step: int, out: StepRollouts):
        """rl.staleness.policy=carry, in the consumer: this step's groups once
        rl.staleness.carry_fraction of them are in (all of them at the run's last step), the rest
        carried into the next step; and the groups carried into this one, waited for whole. Fills
        `out` with what this step trains on, every process's results gathered."""
        n_roll, staleness = self.rollouts_per_problem, self.cfg.rl.staleness
        running = out.running
        last = step + 1 == self.cfg.rl.steps
        # the cut first: what the step trains of its own is decided when enough of it is in,
        # not after waiting on the groups carried into it (by then all of it would be)
        done = await wait_for_groups(running, n_roll, want=len(running.groups) if last else
                                     staleness.wanted(len(running.groups)))
        problems, scored, work = [], [], None
        carried_in = self.carried
        if carried_in is not None:
            await wait_for_groups(carried_in, n_roll, want=len(carried_in.groups))
            problems += [carried_in.problems[b] for b in carried_in.groups]
            scored += gather_groups(carried_in, carried_in.groups, n_roll)
            work = engine.take_owned(("rollout", carried_in.step))
        problems += [running.problems[b] for b in done]
        scored += gather_groups(running, done, n_roll)
        left = [b for b in running.groups if b not in done]
        self.carried = dataclasses.replace(running, groups=left) if left else None
        work = merge_work([work, engine.take_owned(("rollout", step))])
        if work is not None:
            out.timeline.extend("engine", work.busy)
        out.problems, out.scored, out.work = problems, scored, work
        out.rollout_s = time.monotonic() - out.started
        out.counts.update(resumed_counts(running.journal), **{"staleness/carried_in": len(carried_in.groups)
                                                              if carried_in else 0, "staleness/carried_out": len(left)})

    def relaunch_carried(self, engine: Engine, sb):
        """After a restart: the groups the checkpoint says were carried, started again (their
        journals resume them where they were) for the next step to train."""
        c = self.state.carried
        if c is None:
            return None
        by_id = {p.id: p for p in self.train_problems}
        return self.launch(engine, sb, c.step, [by_id[i] for i in c.problem_ids], c.groups).running

    async def my_rollouts(self, engine: Engine, sb, problems, k: int, agent: AgentConfig, seeds,
                          journal: StepJournal | None = None) -> list[Scored]:
        """This process's share (processes.my_share: all of them with one process) of k rollouts
        of every problem, problem-major, rollout i seeded seeds[i]; gathering is the caller's.
        With `journal`, each is saved turn by turn under its index and resumed from there."""
        questions = [p.question for p in problems for _ in range(k)]
        golds = [p.answer for p in problems for _ in range(k)]
        mine = processes.my_share(len(questions))
        return await rollout_problems(engine, sb, self.tokenizer, [questions[i] for i in mine],
                                      [golds[i] for i in mine], agent, [seeds[i] for i in mine], journal=journal,
                                      indices=list(mine))

    async def train(self, engine: Engine, kept: list[KeptRollout], records, timeline: Timeline) -> dict[str, float]:
        """One learner update on the kept rollouts (none kept: no update), then the weights to
        the engine; the learner's per-token entropies go into the kept rollouts' records. The
        update runs on a worker thread: rollouts of later steps go on meanwhile (async mode)."""
        if not kept:
            return {}
        batch = make_batch([k.trajectory.token_ids for k in kept], [k.trajectory.loss_mask for k in kept],
                           [k.trajectory.logprobs for k in kept], [k.advantage for k in kept], pad_multiple=32,
                           max_len=self.cfg.rollout.max_len)
        kl = self.cfg.rl.kl
        with timeline.span("learner"):
            if kl.in_reward:  # the KL to the reference lowers each reward before the group advantage
                seq_kl = await asyncio.to_thread(self.learner.sequence_kl, batch)
                batch.advantages = advantages_with_kl(kept, seq_kl, kl.coef, self.cfg.rl.advantage)
            metrics = await asyncio.to_thread(self.learner.update, batch)
            if kl.in_reward:
                metrics[f"kl_reward_{kl.estimator}"] = float(np.mean(seq_kl))
        if batch.entropy is not None:
            for i, k in enumerate(kept):
                records[k.record]["entropy"] = batch.entropy[i, :len(k.trajectory.token_ids)].tolist()
        with timeline.span("sync"):
            await engine.sync(self.engine_weights(), self.learner.version)
        if engine.weights_on_servers:
            metrics["sync/failures"] = engine.failed_syncs  # this session's so far (each was retried at once)
            if (paused := engine.sync_paused_s()) is not None:  # the process that pushed: how long the servers stood
                metrics["sync/servers_paused_s"] = paused
        return metrics


def resumed_counts(journal: StepJournal) -> dict[str, int]:
    """A step's rollouts this process took back from the journal (rollout/journal.py)."""
    return {"inflight/resumed_finished": journal.counts["finished"], "inflight/resumed_partial": journal.counts["partial"]}


def run(cfg, workdir: str, *, config_mismatch: str = "stop") -> dict[str, Any]:
    return asyncio.run(RLRun(cfg, workdir, config_mismatch=config_mismatch).run())
