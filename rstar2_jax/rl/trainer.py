"""The RL run: SFT warm start (optional), then GRPO-RoC steps.

Every step: next problems of the task -> 2G rollouts each (agent loop, engine, sandbox) ->
rewards and RoC penalties -> RoC keeps G -> advantages -> learner update (old log-probs
recomputed) -> weights to the engine -> traces (Parquet), metrics (JSONL + TensorBoard),
checkpoint (orbax).

The trainer is generic: the task (`data.task`, rstar2_jax.data.tasks), the model
(`models.resolve`) and the engine (`make_engine`) come from the config by name.

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
import copy
import dataclasses
import json
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
from rstar2_jax.learner import Learner, LearnerConfig, UpdateConfig, make_batch
from rstar2_jax.learner.sft import SFTTrainer, iterate_batches
from rstar2_jax.models.resolve import DTYPES
from rstar2_jax.models.tokenizer import Tokenizer
from rstar2_jax.rewards import extract_answer
from rstar2_jax.rl import processes
from rstar2_jax.rl.config import RunConfig, StageConfig
from rstar2_jax.rl.grpo_roc import select_group
from rstar2_jax.rl.prefilter import prefilter_solved
from rstar2_jax.rl.run_dir import RunDirectory
from rstar2_jax.rollout import AgentConfig, PromptFormat, make_format
from rstar2_jax.rollout.engines import Engine, engine_mesh, make_engine
from rstar2_jax.rollout.sandboxes import make_sandbox
from rstar2_jax.rollout.scoring import Scored, rollout_problems, stable_seed, summarize
from rstar2_jax.timeline import BusyLog, Timeline, exclusive_length, overlap_length
from rstar2_jax.traces import TraceWriter, trajectory_record

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


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the n training problems in `epoch`: a fresh permutation every epoch, from
    the run seed (as verl's shuffling loader), so a resumed run replays it exactly."""
    return np.random.default_rng([seed, 0x5EED, epoch]).permutation(n)


def next_problems(problems: Sequence, pos: int, count: int, seed: int, skip: set[str]) -> tuple[list, int]:
    """`count` problems from position `pos` of the shuffled stream (pos counts problems drawn
    since the run began), skipping ids in `skip`; returns them and the new position."""
    n = len(problems)
    if len(skip.intersection(p.id for p in problems)) >= n:
        raise RuntimeError("every training problem has been filtered out as solved")
    batch, order, epoch = [], None, -1
    while len(batch) < count:
        if pos // n != epoch:
            epoch = pos // n
            order = epoch_order(n, seed, epoch)
        p = problems[order[pos % n]]
        pos += 1
        if p.id not in skip:
            batch.append(p)
    return batch, pos


@dataclasses.dataclass
class StepRollouts:
    """What one RL step generated: the problems, their 2G rollouts each (problem-major), timings."""
    problems: list
    scored: list[Scored]
    started: float                 # time.monotonic() when the step's rollouts began
    rollout_s: float
    timeline: Timeline             # tool, reward, engine spans (and learner, sync once trained)
    stats_before: Any              # engine.stats at the start (engines that keep stats)
    load_before: Any               # engine.load() at the start (prefix-cache counters)
    data_meta: dict = dataclasses.field(default_factory=dict)  # the data stream's state after this step's draw


# What the producer of rollouts owns in the run's metadata (the learner owns the rest); a
# checkpoint saves them as they were right after its last trained step's draw.
DATA_META_KEYS = ("data_pos", "solved", "prefiltered_stage")


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
        self.metrics_path = os.path.join(self.workdir, "metrics.jsonl")
        self.learner: Learner | None = None
        self.engine_busy = BusyLog()  # the engine's busy intervals, shared by overlapping steps' windows
        self._solved_after: dict[int, list[str]] = {}  # step -> problems solved k/k once it trained (online filter)
        self._tb = None  # TensorBoard writer (primary process), opened on first use (tensorboard())
        self._evaluated = False  # an evaluation ran in this call of run()

    @property
    def train_problems(self):
        return self.task.train_problems

    @property
    def eval_problems(self):
        return self.task.eval_problems

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
            self._log({"phase": "sft", "step": i, **m})
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
        self._log({"phase": "eval", "label": label, "step": step, **{f"{k}/{m}": v for k, s in out.items()
                                                                         for m, v in s.items()}})
        return out

    def _log(self, record: dict[str, Any]):
        """metrics.jsonl, and TensorBoard: RL steps under their names, SFT steps under sft/, the
        before/after evaluations under eval/<label>/ (at the RL step they ran at)."""
        if not processes.is_primary():
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"time": time.time(), **record}) + "\n")
        phase = record.get("phase")
        prefix = {"rl": "", "sft": "sft/", "eval": f"eval/{record.get('label', '')}/"}.get(phase)
        if prefix is None:
            return
        tb = self.tensorboard()
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                tb.add_scalar(prefix + k, v, record["step"])

    def tensorboard(self):
        """The run's TensorBoard writer (primary process), opened on first use: a re-run with
        nothing to log adds no event file."""
        if self._tb is None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(self.workdir, "tensorboard"))
        return self._tb

    def learner_config(self) -> LearnerConfig:
        rl = self.cfg.rl
        constant = rl.loss.constant_tokens or max(s.max_response_tokens for s in self.cfg.stages)
        update = UpdateConfig(loss=rl.loss, kl=rl.kl, temperature=self.cfg.rollout.temperature,
                              micro_batches=rl.micro_batches, tis_cap=rl.tis_cap or None, constant_tokens=constant)
        return LearnerConfig(lr=rl.lr, warmup_steps=rl.warmup_steps, weight_decay=rl.weight_decay,
                             grad_clip=rl.grad_clip, token_entropy=rl.token_entropy, update=update,
                             mini_batches=rl.mini_batches, epochs=rl.epochs)

    # ------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Evaluate before RL, train to rl.steps, evaluate after; a re-run of a finished run
        reports its results without evaluating again."""
        cfg = self.cfg
        try:
            async with self.session() as (engine, sb, meta):
                results = dict(meta.get("results", {}))
                finished = self.run_dir.load_results()
                if meta["rl_step"] >= cfg.rl.steps and "after" in finished:  # evaluated at this step already
                    results["after"] = finished["after"]
                if cfg.eval.before_and_after and "before" not in results:
                    results["before"] = await self.evaluate(engine, sb, meta["rl_step"], "before_rl")
                    meta["results"] = results
                await self.train_steps(engine, sb, meta)
                if cfg.eval.before_and_after and "after" not in results:
                    results["after"] = await self.evaluate(engine, sb, cfg.rl.steps, "after_rl")
            if processes.is_primary():
                self.run_dir.save_results(results)
                if self._evaluated:  # the before/after table as text, once per evaluation that ran
                    self.tensorboard().add_text(
                        "results", "\n".join("    " + line for line in format_results(results).splitlines()),
                        cfg.rl.steps)
        finally:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
        return results

    @contextlib.asynccontextmanager
    async def session(self):
        """The learner (resumed from the last checkpoint, or after SFT), the sandbox and the engine
        holding the learner's weights; yields (engine, sandbox, run metadata)."""
        cfg = self.cfg
        lcfg = self.learner_config()
        latest = self.checkpoints.latest_step()
        meta = {"rl_step": 0, "data_pos": 0, "version": 0, "stage": 0, "results": {}}
        warm_start = latest is None and cfg.sft.steps > 0
        # The learner owns the loaded (or SFT'd) arrays: no second copy of the model. From its first
        # update on, self.model serves only as the architecture (model_with).
        start_model = self.model_with(self.sft()) if warm_start else self.model
        self.learner = Learner(start_model, lcfg, mesh=self.mesh, own_params=True)
        if latest is not None:
            state, meta = self.checkpoints.restore(latest, self.learner.state)
            self.learner.state = state
            self.learner.version = meta["version"]
            print(f"resumed from {self.checkpoints.directory} step {latest}")
        elif warm_start:
            self.checkpoints.save(0, self.learner.state, meta)
        weights = self.engine_weights()  # one copy (or gather) for the engine's model and its version
        try:
            async with make_sandbox(cfg.sandbox) as sb, \
                    self.make_engine(self.model_with(weights)) as engine:
                await self.push_weights(engine, weights, self.learner.version)
                yield engine, sb, meta
        finally:
            self.checkpoints.close()

    async def train_steps(self, engine: Engine, sb, meta: dict[str, Any]):
        """RL steps from meta["rl_step"] to rl.steps: a producer task generates each step's
        rollouts (at most rl.max_staleness steps ahead of the learner), this coroutine trains on
        them in order, logs and checkpoints."""
        cfg = self.cfg
        start, lag = meta["rl_step"], cfg.rl.max_staleness
        self._solved_after = {start - 1: list(meta.get("solved", []))}
        ready: asyncio.Queue = asyncio.Queue()
        trained = asyncio.Condition()
        done = {"steps": start}  # steps the learner has finished

        launched: list[asyncio.Task] = []

        async def produce():
            # Each step's rollouts start as soon as the staleness bound allows, even while an
            # earlier step's stragglers still run: engines fill with the next step's work
            # instead of idling on the slowest trajectory. Steps still draw their problems in order.
            # The producer runs no collective (several processes): its rollouts stay this
            # process's share until the trainer gathers them, in step order, between updates.
            data_meta = {k: copy.deepcopy(meta[k]) for k in DATA_META_KEYS if k in meta}
            try:
                for step in range(start, cfg.rl.steps):
                    # An offline pre-filter samples with the previous stage's final policy, and
                    # its rollouts are gathered: every earlier step is trained first.
                    ready_after = step if self.prefilter_begins(step, data_meta) else step - lag
                    async with trained:
                        await trained.wait_for(lambda: done["steps"] >= ready_after)
                    problems, drawn = await self.draw(engine, sb, step, data_meta)
                    launched.append(asyncio.create_task(self.roll_out(engine, sb, step, problems, drawn)))
                    ready.put_nowait(launched[-1])
            except BaseException as e:  # the trainer re-raises it; nothing waits forever
                ready.put_nowait(e)
                raise

        producer = asyncio.create_task(produce())
        bar = tqdm(range(start, cfg.rl.steps), initial=start, total=cfg.rl.steps, desc="GRPO-RoC", dynamic_ncols=True)
        last_end = time.monotonic()
        try:
            for step in bar:
                out = await ready.get()
                if isinstance(out, BaseException):
                    raise out
                out = await out
                metrics = await self.consume(engine, step, out, meta)
                metrics["time/interval_s"] = time.monotonic() - last_end  # wall time per step, overlap included
                last_end = time.monotonic()
                self._log(metrics)
                bar.write(format_breakdown(metrics))
                bar.set_postfix(acc=f"{metrics['accuracy']:.2f}", p_err=f"{metrics['tool_error_ratio_correct']:.2f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                meta.update({k: v for k, v in out.data_meta.items() if k != "solved"})  # as of the step's draw
                meta["rl_step"] = step + 1
                meta["version"] = self.learner.version
                if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.rl.steps:
                    self.checkpoints.save(step + 1, self.learner.state, meta)
                async with trained:
                    done["steps"] = step + 1
                    trained.notify_all()
        finally:
            for task in (producer, *launched):
                task.cancel()
            for task in (producer, *launched):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def engine_weights(self):
        """The learner's parameters for this process's embedded engine: in the compute dtype (a
        bf16 run samples with bf16 weights, as the learner computes with them) and split over
        the engine's mesh (`engine_mesh`). The learner's update donates its buffers, so this is
        a copy, except in the one case where sharing is safe and costs nothing: float32, one
        process, one device, on-policy (the engine is idle during updates). vLLM servers get
        the float32 master weights, cast on export (rollout.vllm_export_dtype)."""
        params = self.learner.model_state()
        dtype = DTYPES[self.cfg.model.dtype] if self.cfg.rollout.engine == "jax" else None
        mesh = engine_mesh(self.cfg.model.decode_attention) if self.cfg.rollout.engine == "jax" else None
        if dtype in (None, jnp.float32) and mesh is None and self.cfg.rl.max_staleness == 0 \
                and jax.process_count() == 1 and self.mesh is None:
            return params
        return processes.local_copy(params, dtype, sharding.param_shardings(params, mesh) if mesh else None)

    def model_with(self, params):
        """The run's model architecture with `params` (an nnx.State of its Params)."""
        from flax import nnx
        graphdef, _ = nnx.split(self.model, nnx.Param)
        return nnx.merge(graphdef, params)

    # ------------------------------------------------------------------------------------------
    # one RL step: rollouts (produce) -> selection -> training -> metrics (consume)
    async def produce(self, engine: Engine, sb, step: int, data_meta: dict[str, Any]) -> StepRollouts:
        """Step `step`'s problems and this process's share of their rollouts; advances the data
        stream in `data_meta` (position, the stage's pre-filtered problems) and keeps a copy of it
        in the result."""
        problems, drawn = await self.draw(engine, sb, step, data_meta)
        return await self.roll_out(engine, sb, step, problems, drawn)

    def prefilter_begins(self, step: int, data_meta: dict[str, Any]) -> bool:
        stage_i = self.cfg.stage_index(step)
        stage = self.cfg.stages[stage_i]
        return bool(stage.filter_solved_k) and stage.filter_mode == "offline" and \
            data_meta.get("prefiltered_stage") != stage_i

    def skipped_problems(self, step: int, data_meta: dict[str, Any]) -> set[str]:
        """The problems step `step` may not draw: the stage's pre-filter result (offline), or
        those solved k/k by the steps trained before it could start (online: steps up to
        step - 1 - rl.max_staleness; the same set in every process and every rerun)."""
        stage = self.cfg.stage(step)
        if not stage.filter_solved_k:
            return set()
        if stage.filter_mode == "offline":
            return set(data_meta.get("solved", []))
        known = [s for s in self._solved_after if s <= step - 1 - self.cfg.rl.max_staleness]
        return set(self._solved_after[max(known)] if known else data_meta.get("solved", []))

    async def draw(self, engine: Engine, sb, step: int, data_meta: dict[str, Any]) -> tuple[list, dict[str, Any]]:
        """Step `step`'s problems (after the stage's pre-filter, when it begins); advances
        `data_meta` and returns a copy of it as of this draw (what a checkpoint after this step saves)."""
        cfg = self.cfg
        if self.prefilter_begins(step, data_meta):
            stage_i = cfg.stage_index(step)
            data_meta["solved"] = sorted(await self.prefilter(engine, sb, stage_i, step))
            data_meta["prefiltered_stage"] = stage_i
        problems, data_meta["data_pos"] = next_problems(self.train_problems, data_meta.get("data_pos", 0),
                                                        cfg.rl.batch_problems, cfg.seed,
                                                        self.skipped_problems(step, data_meta))
        return problems, copy.deepcopy(data_meta)

    async def roll_out(self, engine: Engine, sb, step: int, problems, drawn: dict[str, Any]) -> StepRollouts:
        """This process's share of the step's rollouts (all of them with one process)."""
        out = await self.generate(engine, sb, step, problems)
        out.data_meta = drawn
        return out

    async def consume(self, engine: Engine, step: int, out: StepRollouts, meta: dict[str, Any]) -> dict[str, Any]:
        """Every process's rollouts of the step gathered (a collective: called in step order, never
        beside an update), the stage's problem filter, RoC selection, the update (weights then go
        to the engine) and the step's traces; returns the step's metrics."""
        cfg = self.cfg
        out.scored = processes.gather_shares(out.scored, len(out.problems) * self.rollouts_per_problem)
        self.record_solved(step, out, meta)
        stage_i = cfg.stage_index(step)
        if stage_i != meta.get("stage", 0):
            if cfg.stages[stage_i].reset_optimizer:
                self.learner.reset_optimizer()
            meta["stage"] = stage_i
        staleness = self.check_staleness(step, out)
        rows, records = self.select(step, out)
        train_metrics = await self.train(engine, rows, records, out.timeline)
        if processes.is_primary():
            self.traces.write(step, records)  # after the update: a crash before it redoes the step anyway
        return {"phase": "rl", "step": step, "stage": meta["stage"],
                **self.step_metrics(engine, out, len(rows)), **staleness, **train_metrics}

    def record_solved(self, step: int, out: StepRollouts, meta: dict[str, Any]):
        """meta["solved"] after step `step`: the draw's (the pre-filter's, or what earlier steps
        solved), plus, under the online filter, the problems this step's first k rollouts all
        solved. A problem the latest policy solves k/k teaches nothing more."""
        stage = self.cfg.stage(step)
        if stage.filter_solved_k and stage.filter_mode == "offline":
            solved = set(out.data_meta.get("solved", []))
        else:
            solved = set(meta.get("solved", out.data_meta.get("solved", [])))
            if stage.filter_solved_k:
                solved |= solved_ids(out, self.rollouts_per_problem, stage.filter_solved_k)
        meta["solved"] = sorted(solved)
        self._solved_after[step] = meta["solved"]

    def check_staleness(self, step: int, out: StepRollouts) -> dict[str, float]:
        """How many versions each sampled token lags the learner about to train on it, by the
        weights that sampled it and by the oldest weights whose KV it read (a partial rollout
        keeps KV from before a sync); raises if either lags more than rl.max_staleness (the
        pipeline's invariant)."""
        version = self.learner.version
        lags = [version - v for s in out.scored for v in s.trajectory.versions if v >= 0]
        kv_lags = [version - v for s in out.scored for v in s.trajectory.kv_versions if v >= 0]
        worst, kv_worst = max(lags, default=0), max(kv_lags, default=0)
        if max(worst, kv_worst) > self.cfg.rl.max_staleness:
            raise RuntimeError(f"step {step}: a token sampled {worst} versions ago (KV {kv_worst} versions old) "
                               f"exceeds rl.max_staleness={self.cfg.rl.max_staleness}")
        return {"staleness/max": float(worst), "staleness/mean": float(np.mean(lags)) if lags else 0.0,
                "staleness/kv_max": float(kv_worst)}

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
        self._log({"phase": "prefilter", "stage": stage_i, "step": step, "problems": n, "dropped": len(solved)})
        return solved

    @property
    def rollouts_per_problem(self) -> int:
        return self.cfg.rl.rollouts_per_problem

    async def generate(self, engine: Engine, sb, step: int, problems) -> StepRollouts:
        """This process's share of the 2G rollouts of every problem, concurrently, with the step's
        seeds (the trainer gathers the shares: consume)."""
        cfg, n_roll = self.cfg, self.rollouts_per_problem
        seeds = [stable_seed(cfg.seed, "rollout", step, b, j) for b in range(len(problems)) for j in range(n_roll)]
        start = time.monotonic()
        timeline = Timeline()
        window = self.engine_busy.open(engine)
        stats_before = dataclasses.replace(engine.stats) if engine.stats is not None else None
        load_before = engine.load()
        with timeline.activate():
            scored = await self.my_rollouts(engine, sb, problems, n_roll, self.agent_config(step), seeds)
        rollout_s = time.monotonic() - start - timeline.union("reward")
        timeline.extend("engine", self.engine_busy.close(engine, window))  # the engine's work in this step's window
        return StepRollouts(list(problems), scored, start, rollout_s, timeline, stats_before, load_before)

    async def my_rollouts(self, engine: Engine, sb, problems, k: int, agent: AgentConfig, seeds) -> list[Scored]:
        """This process's share (processes.my_share: all of them with one process) of k rollouts
        of every problem, problem-major, rollout i seeded seeds[i]; gathering is the caller's."""
        questions = [p.question for p in problems for _ in range(k)]
        golds = [p.answer for p in problems for _ in range(k)]
        mine = processes.my_share(len(questions))
        return await rollout_problems(engine, sb, self.tokenizer, [questions[i] for i in mine],
                                      [golds[i] for i in mine], agent, [seeds[i] for i in mine])

    def select(self, step: int, out: StepRollouts) -> tuple[list[tuple[Any, float, int]], list[dict]]:
        """RoC per group: (trajectory, advantage, record index) of each kept rollout, and the
        trace record of every rollout (kept or not)."""
        cfg, n_roll = self.cfg, self.rollouts_per_problem
        rng = np.random.default_rng([cfg.seed, step])
        rows, records = [], []
        for b, problem in enumerate(out.problems):
            group = out.scored[b * n_roll:(b + 1) * n_roll]
            sel = select_group(group, cfg.rl.group_size, rng, mode=cfg.rl.roc.mode, eps=cfg.rl.roc.eps,
                               min_neg=cfg.rl.roc.min_neg, min_pos=cfg.rl.roc.min_pos, advantage=cfg.rl.advantage,
                               reject_uniform=cfg.rl.roc.reject_uniform_groups)
            adv_of = dict(zip(sel.kept.tolist(), sel.advantages.tolist()))
            for j, s in enumerate(group):
                t = s.trajectory
                if j in adv_of:
                    rows.append((t, adv_of[j], len(records)))
                records.append(trajectory_record(
                    t, run=cfg.run_name, step=step, problem_id=problem.id, sample_index=j, problem=problem.question,
                    gold=problem.answer, extracted_answer=extract_answer(t.response_text), reward=s.reward,
                    p_err=float(sel.p_err[j]), p_format=float(sel.p_format[j]), kept=j in adv_of,
                    advantage=float(adv_of.get(j, 0.0))))
        return rows, records

    async def train(self, engine: Engine, rows, records, timeline: Timeline) -> dict[str, float]:
        """One learner update on the kept rollouts (none kept: no update), then the weights to
        the engine; the learner's per-token entropies go into the kept rollouts' records. The
        update runs on a worker thread: rollouts of later steps go on meanwhile (async mode)."""
        if not rows:
            return {}
        batch = make_batch([t.token_ids for t, _, _ in rows], [t.loss_mask for t, _, _ in rows],
                           [t.logprobs for t, _, _ in rows], [a for _, a, _ in rows], pad_multiple=32,
                           max_len=self.cfg.rollout.max_len)
        with timeline.span("learner"):
            metrics = await asyncio.to_thread(self.learner.update, batch)
        if batch.entropy is not None:
            for i, (t, _, r) in enumerate(rows):
                records[r]["entropy"] = batch.entropy[i, :len(t.token_ids)].tolist()
        with timeline.span("sync"):
            await self.push_weights(engine, self.engine_weights(), self.learner.version)
        return metrics

    async def push_weights(self, engine: Engine, params, version: int):
        """The learner's weights to the engine. Weights on shared servers (vLLM) are pushed by
        the primary process alone, on a worker thread (rollouts in flight go on meanwhile); the
        others take the version on once it is there (a barrier), so no token is stamped with a
        version its server does not have yet. An embedded engine is updated in place."""
        if not engine.weights_on_servers:
            engine.update_weights(params, version)
            return
        if processes.is_primary():
            await asyncio.to_thread(engine.update_weights, params, version)
        processes.barrier(f"weights v{version} on the servers")
        if not processes.is_primary():
            engine.adopt_weights(params, version)

    def step_metrics(self, engine: Engine, out: StepRollouts, kept: int) -> dict[str, float]:
        summary = summarize(out.scored)
        gen_tokens = sum(int(np.sum(s.trajectory.loss_mask)) for s in out.scored)
        step_s = time.monotonic() - out.started
        load = engine.load()
        queries = load.prefix_cache_queries - out.load_before.prefix_cache_queries
        cache = ({"engine/prefix_cache_hit_rate": (load.prefix_cache_hits - out.load_before.prefix_cache_hits) / queries}
                 if queries > 0 else {})  # servers that report their prefix cache (vLLM)
        return {
            **summary,  # the shared METRICS (rollout/scoring.py; README's metric table), over the step's rollouts
            "kept_rollouts": kept, "rollout_s": out.rollout_s, "tokens_per_s": gen_tokens / max(out.rollout_s, 1e-9),
            **step_breakdown(out.timeline, out.rollout_s, step_s, out.stats_before, engine.stats), **cache,
        }


def solved_ids(out: StepRollouts, n_roll: int, k: int) -> set[str]:
    """The stage's online data filter: problems whose first k rollouts of this step all scored
    (k = 2G: every rollout). A problem the latest policy solves k/k teaches nothing more."""
    return {p.id for b, p in enumerate(out.problems)
            if all(s.reward > 0 for s in out.scored[b * n_roll:b * n_roll + k])}


def step_breakdown(timeline: Timeline, rollout_s: float, step_s: float, stats_before, stats_after) -> dict[str, float]:
    """Wall-time breakdown of one RL step and how busy the engine was.

    tool_s: wall time with at least one tool call in flight; tool_wait_s: the part of it with
    the engine idle (the pipeline waited on tools); tool_overlap: the share of tool time hidden
    behind generation. engine_busy: share of the rollout the engine spent on device work while at
    least one of this step's own requests was in it (its "request" spans; with asynchronous
    rollouts the engine also works for other steps, which does not count);
    engine_slot_utilization: share of decode-step slots that held a request; engine/prefill_tokens,
    reused_tokens, preemptions: prompt tokens run at admission, prompt tokens whose KV was kept
    from the previous turn, requests preempted for pages (engines with stats).
    """
    delta = stats_after.since(stats_before) if stats_before is not None else None
    tool_s = timeline.union("tool")
    tool_wait_s = exclusive_length(timeline.get("tool"), timeline.get("engine"))
    return {
        "time/step_s": step_s, "time/rollout_s": rollout_s, "time/reward_s": timeline.union("reward"),
        "time/learner_s": timeline.union("learner"), "time/sync_s": timeline.union("sync"),
        "time/tool_s": tool_s, "time/tool_wait_s": tool_wait_s,
        "time/tool_wait_share": tool_wait_s / max(rollout_s, 1e-9),
        "time/tool_overlap": 1.0 - tool_wait_s / tool_s if tool_s > 0 else 0.0,
        "engine/busy": overlap_length(timeline.get("engine"), timeline.get("request")) / max(rollout_s, 1e-9),
        **({"engine/slot_utilization": delta.slot_utilization, "engine/prefill_tokens": delta.prefill_tokens,
            "engine/reused_tokens": delta.reused_tokens, "engine/preemptions": delta.preemptions}
           if delta is not None else {}),
    }


def format_breakdown(m: dict[str, float]) -> str:
    slots = f", slots {m['engine/slot_utilization']:.0%}" if "engine/slot_utilization" in m else ""
    return (f"step {m['step']}: {m['time/step_s']:.1f}s = rollout {m['time/rollout_s']:.1f}s (engine busy "
            f"{m['engine/busy']:.0%}{slots}; tools {m['time/tool_s']:.1f}s, "
            f"{m['time/tool_overlap']:.0%} overlapped, wait {m['time/tool_wait_s']:.2f}s) + reward "
            f"{m['time/reward_s']:.2f}s + learner {m['time/learner_s']:.1f}s + sync {m['time/sync_s']:.2f}s")


def format_results(results: dict[str, Any]) -> str:
    rows = [("", "accuracy greedy", "accuracy sampled", "tool-error ratio (correct)", "tool calls", "response tokens")]
    for label in ("before", "after"):
        if label in results:
            g, s = results[label]["greedy"], results[label]["sampled"]
            rows.append((f"{label} RL", f"{g['accuracy']:.1%}", f"{s['accuracy']:.1%}",
                         f"{s['tool_error_ratio_correct']:.3f}", f"{s['mean_tool_calls']:.2f}",
                         f"{s['mean_response_tokens']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def run(cfg, workdir: str, *, config_mismatch: str = "stop") -> dict[str, Any]:
    return asyncio.run(RLRun(cfg, workdir, config_mismatch=config_mismatch).run())
