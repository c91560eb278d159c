"""The RL run: SFT warm start (optional), then GRPO-RoC steps, evaluated before and after.

RLRun is wiring. A step: the data stream draws problems (rl/data_stream.py) -> the rollout
producer rolls them out (rl/rollouts.py: engine, sandbox, seeds, shares, journal) -> the consumer
gathers them (carry.py cuts a step under rl.staleness=carry), applies the stage's filter and
dynamic sampling, RoC selection (rl/grpo_roc.py), the learner's update, the engine's weight sync
(Engine.sync_weights), traces, metrics (rl/step_metrics.py) and checkpoints; the staleness-gated loop that
overlaps producer and consumer is rl/pipeline.py. The task, the model and the engine come from the
config by name.

Reproducible: every rollout's sampling seed, every RoC draw and the per-epoch data order derive
from (config seed, step, problem, sample), so a run resumed from its last checkpoint continues as
it would have; with rl.max_staleness = 0 exactly (the paper's on-policy loop), with k > 0 with the
same data and seeds (which tokens a sync reaches depends on timing).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from rstar2_jax import models
from rstar2_jax.core import processes
from rstar2_jax.core import sharding
from rstar2_jax.core.checkpoints import RunCheckpoints
from rstar2_jax.data.tasks import make_task
from rstar2_jax.learner import Learner, make_batch
from rstar2_jax.learner.sft import SFTTrainer
from rstar2_jax.models.adapter_files import base_identity
from rstar2_jax.models.resolve import load_policy
from rstar2_jax.models.tokenizer import Tokenizer
from rstar2_jax.rl import carry, dynamic_sampling
from rstar2_jax.rl.config import RunConfig, check_prompt_room, validate
from rstar2_jax.rl.memory_plan import resolve_token_budget
from rstar2_jax.rl.data_stream import DataStream, solved_ids
from rstar2_jax.rl.engine_weights import engine_weights
from rstar2_jax.rl.idle_watch import IdleWatch
from rstar2_jax.rl.grpo_roc import KeptRollout, advantages_with_kl, select_step
from rstar2_jax.rl.pipeline import run_pipeline, token_staleness
from rstar2_jax.rl.prefilter import prefilter_stage
from rstar2_jax.rl.rollouts import RolloutProducer
from rstar2_jax.rl.run_dir import RunDirectory
from rstar2_jax.rl.carry import RunningGroups
from rstar2_jax.rl.run_state import DataState, RunState
from rstar2_jax.rl.seeds import eval_seeds
from rstar2_jax.rl.step_metrics import MetricsLog, format_breakdown, format_results, step_metrics
from rstar2_jax.rl.step_rollouts import StepRollouts
from rstar2_jax.rollout import journal, make_format
from rstar2_jax.rollout.engines import engine_kind, make_engine
from rstar2_jax.rollout.sandboxes import make_sandbox
from rstar2_jax.rollout.scoring import summarize
from rstar2_jax.core.timeline import Timeline
from rstar2_jax.traces import TraceWriter

__all__ = ["RLRun", "run"]


class RLRun:
    def __init__(self, cfg: ml_collections.ConfigDict | RunConfig, workdir: str, *, config_mismatch: str = "stop",
                 before: dict[str, Any] | None = None):
        """`config_mismatch`: what a config that differs from the run directory's config.json does
        ("stop": ConfigMismatchError naming the keys; "ok": the change goes into the run's config
        history). Extending rl.steps and the like never stops (run_dir.RESUMABLE_CHANGES).
        `before`: the before-RL evaluation made by a run of the same weights and settings (ablate)."""
        cfg = validate(cfg)
        self.cfg, self.workdir, self.known_before = cfg, os.path.abspath(workdir), before
        self.run_dir = RunDirectory(self.workdir)
        self.fmt = make_format(cfg.format)
        if processes.is_primary():  # the others read what it wrote (one run directory)
            self.run_dir.record_config(cfg.to_dict(), config_mismatch)
            self.model_dir = models.resolve(cfg.model, self.workdir, seed=cfg.seed)
            self.run_dir.write_run_info({"model_dir": os.path.abspath(self.model_dir), "run_name": cfg.run_name,
                                         "format": cfg.format, "answer_format": cfg.data.answer_format})
        processes.barrier("run directory written")
        # rl.token_budget=-1 becomes a number here, after the run directory recorded the config as
        # written (a resumed run compares that), before anything reads it
        self.cfg = cfg = resolve_token_budget(cfg, jax.process_count())
        if not processes.is_primary():
            self.model_dir = models.resolve(cfg.model, self.workdir, seed=cfg.seed)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.task = make_task(cfg.data, cfg.seed)
        check_prompt_room(self.fmt, self.tokenizer, [*self.task.train_problems, *self.task.eval_problems],
                          cfg.stages, cfg.rollout.max_len)
        # The mesh exists before the weights: each tensor streams from its safetensors file straight
        # onto its shards (one host tensor at a time), and the learner then owns those arrays.
        # the learner's devices: all of them, or the rest when the engine has its own (rollout.jax.devices)
        self.learner_devices, _ = engine_kind(cfg.rollout).devices(cfg.rollout, jax.devices())
        self.mesh = (sharding.make_mesh(**cfg.mesh.axes(), devices=self.learner_devices)
                     if len(self.learner_devices) > 1 else None)
        self.model = load_policy(cfg.model, self.model_dir, seed=cfg.seed, mesh=self.mesh)
        self.checkpoints = RunCheckpoints(os.path.join(self.workdir, "checkpoints"), keep=cfg.checkpoint.keep,
                                          base=base_identity(self.model_dir) if cfg.model.lora.enabled else None)
        self.traces = TraceWriter(os.path.join(self.workdir, "traces"))
        self.log = MetricsLog(self.workdir, cfg.logging, cfg.run_name, cfg.to_dict())
        self.learner: Learner | None = None
        self.data: DataStream | None = None  # the training problems' stream (train_steps)
        self.producer: RolloutProducer | None = None  # every rollout of the session goes through it
        self._evaluated = False  # an evaluation ran in this call of run()
        self.inflight_dir = os.path.join(self.workdir, "inflight")  # in-flight rollouts (rollout/journal.py)
        self.restored_version = 0  # weights version the session started from (the checkpoint's)
        self.carried: RunningGroups | None = None  # rl.staleness.policy=carry: groups the next step trains

    # ------------------------------------------------------------------------------------------
    def sft(self):
        c = self.cfg.sft
        data = self.task.sft_data(self.tokenizer, self.fmt, c.examples, seed=self.cfg.seed + 2)
        trainer = SFTTrainer(self.model, lr=c.lr, warmup_steps=c.warmup_steps, pad_multiple=32,
                             token_budget=c.token_budget, segments_per_row=c.segments_per_row)
        trainer.train(data, c.steps, c.batch_size, self.cfg.seed,
                      on_step=lambda i, m: self.log.write({"phase": "sft", "step": i, **m}))
        return trainer.params()

    async def evaluate(self, step: int, label: str, known: dict[str, Any] | None = None) -> dict[str, Any]:
        """Greedy and sampled on the eval problems; `known` (another run's): logged as shared, not rerun."""
        probs, out = self.task.eval_problems, dict(known or {})
        if not known:  # the weights evaluated are the last ones sent (sync_wait=export: maybe still landing)
            await self.producer.engine.latest_landed()
        for name, temperature in () if known else (("greedy", 0.0), ("sampled", self.cfg.rollout.temperature)):
            seeds = eval_seeds(self.cfg.seed, label, name, len(probs))
            with tqdm(total=len(probs), desc=f"eval {label} ({name})", dynamic_ncols=True, leave=False,
                      disable=not processes.is_primary()) as bar:
                scored = await self.producer.everywhere(probs, self.producer.agent(step, temperature), seeds, bar)
            out[name] = summarize(scored)
        self._evaluated = True
        self.log.write({"phase": "eval", "label": label, "step": step, **({"shared": 1} if known else {}),
                        **{f"{k}/{m}": v for k, s in out.items() for m, v in s.items()}})
        return out

    async def evaluate_during(self, steps_done: int):
        """eval.every: the held-out evaluation after `steps_done` RL steps (not after the last: the
        after-RL one is that), its result kept in the run state that the next checkpoint saves."""
        every, label = self.cfg.eval.every, f"step_{steps_done}"
        if not every or steps_done % every or steps_done >= self.cfg.rl.steps or label in self.state.results:
            return
        out = await self.evaluate(steps_done, label)
        self.state = dataclasses.replace(self.state, results={**self.state.results, label: out})

    # ------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Evaluate before RL, train to rl.steps, evaluate after; a re-run of a finished run
        reports its results without evaluating again."""
        cfg = self.cfg
        try:
            async with self.session():
                state = self.state
                results = dict(state.results)
                finished = self.run_dir.load_results()
                if state.rl_step >= cfg.rl.steps and "after" in finished:  # evaluated at this step already
                    results["after"] = finished["after"]
                if cfg.eval.before_and_after and "before" not in results:
                    results["before"] = await self.evaluate(state.rl_step, "before_rl", self.known_before)
                    self.state = dataclasses.replace(self.state, results=results)
                await self.train_steps()
                if cfg.eval.before_and_after and "after" not in results:
                    results["after"] = await self.evaluate(cfg.rl.steps, "after_rl")
            if processes.is_primary():  # before and after RL (those during it: metrics.jsonl, eval/step_<N>)
                self.run_dir.save_results({k: v for k, v in results.items() if k in ("before", "after")})
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
        holding the learner's weights, and the rollout producer over them (`self.producer`, also
        yielded). The run state is `self.state` (a new value after every trained step)."""
        cfg = self.cfg
        latest = self.checkpoints.latest_step()
        self.state = RunState()
        warm_start = latest is None and cfg.sft.steps > 0
        if latest is None:  # everything runs (again): a killed first attempt's rows go
            self.log.resume_at(None, set())
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
            # the rows of the work about to run again go: every step is in metrics.jsonl once
            self.log.resume_at(latest, set(self.state.results) | set(self.run_dir.load_results()))
        elif warm_start:
            self.save_checkpoint(0)
        # saved in-flight tokens of weights newer than these were lost with the crash (journal.py)
        self.restored_version = self.learner.version
        # one copy (or gather) for the engine's model and its version
        weights = engine_weights(self.learner, cfg, len(self.learner_devices))
        try:
            async with make_sandbox(cfg.sandbox) as sb, \
                    make_engine(cfg.rollout, self.model_with(weights), self.tokenizer, seed=cfg.seed) as engine:
                await engine.sync_weights(weights, self.learner.version)
                # landed before anything samples (sync_wait=export returns at the export): the
                # evaluation, the carried groups relaunched at a resume, the first draws
                await engine.latest_landed()
                self.producer = RolloutProducer(cfg, engine, sb, self.tokenizer, self.fmt,
                                                inflight_dir=self.inflight_dir, restored_version=self.restored_version)
                yield self.producer
        finally:
            self.checkpoints.close()

    def save_checkpoint(self, step: int):
        self.checkpoints.save(step, self.learner.state, self.state.to_json(), reference=self.learner.ref_params)
        if processes.is_primary():  # the in-flight rollouts of trained steps are in the checkpoint now
            carried = self.state.carried  # ... except a carried group's, trained at the next step
            journal.prune(self.inflight_dir, step if carried is None else min(step, carried.step))

    async def train_steps(self):
        """RL steps from the run state's rl_step to rl.steps through the pipeline: a producer
        draws each step's problems and starts its rollouts (at most rl.max_staleness steps ahead
        of the learner); the consumer trains on them in order, logs and checkpoints."""
        cfg = self.cfg
        start = self.state.rl_step
        self.data = self.data_stream()
        bar = tqdm(range(start, cfg.rl.steps), initial=start, total=cfg.rl.steps, desc="GRPO-RoC", dynamic_ncols=True)
        idle = IdleWatch(cfg.rl.idle)  # steps that train nothing: warn, or stop (rl.idle)
        last_end = time.monotonic()

        async def draw(step: int):
            # the weights the pipeline promises this step's rollouts: with rollout.vllm.sync_wait=export
            # the last sync may still be landing on the servers (vllm_engine/sync/background.py)
            await self.producer.engine.latest_landed()
            return self.producer.step_rollouts(step, *await self.draw(step))

        self.carried = carry.relaunch(self.state.carried, self.producer, self.task.train_problems)  # carried at the checkpoint

        async def consume(step: int, out: StepRollouts):
            nonlocal last_end
            metrics = await self.consume(step, out)
            metrics["time/interval_s"] = time.monotonic() - last_end  # wall time per step, overlap included
            last_end = time.monotonic()
            self.log.write(metrics)
            bar.update(1)
            bar.write(format_breakdown(metrics))
            if (said := idle.observe(step, metrics)) and processes.is_primary():
                bar.write(said)
            bar.set_postfix(acc=f"{metrics['accuracy']:.2f}", p_err=f"{metrics['tool_error_ratio_correct']:.2f}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
            await self.evaluate_during(step + 1)
            if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.rl.steps:
                self.save_checkpoint(step + 1)

        try:
            # An offline pre-filter samples with the previous stage's final policy, and its
            # rollouts are gathered: every earlier step is trained first (an exclusive draw).
            await run_pipeline(range(start, cfg.rl.steps), max_lag=cfg.rl.max_staleness, draw=draw, consume=consume,
                               exclusive=self.data.prefilter_begins)
        finally:
            bar.close()

    def model_with(self, params):
        """The run's model architecture with `params` (an nnx.State of its Params)."""
        graphdef, _ = nnx.split(self.model, nnx.Param)
        return nnx.merge(graphdef, params)

    # ------------------------------------------------------------------------------------------
    # one RL step: rollouts (draw, roll_out) -> selection -> training -> metrics (consume)
    def data_stream(self) -> DataStream:
        """The training problems' stream as the run state left it (a fresh run: from the start)."""
        return DataStream(self.task.train_problems, self.cfg, self.state.data, self.state.rl_step)

    async def draw(self, step: int) -> tuple[list, DataState]:
        """Step `step`'s problems and the data stream's state after the draw (the stage's
        pre-filter first, when it begins). The stream starts where the run state left it."""
        if self.data is None:
            self.data = self.data_stream()
        return await self.data.draw(step, self.prefilter)

    async def consume(self, step: int, out: StepRollouts) -> dict[str, Any]:
        """Every process's rollouts of the step gathered (a collective: called in step order, never
        beside an update), the stage's problem filter, RoC selection, the update (weights then go
        to the engine) and the step's traces; advances the run state; returns the step's metrics."""
        cfg = self.cfg
        engine = self.producer.engine
        out, self.carried = await carry.gathered(out, self.carried, engine, n_roll=cfg.rl.rollouts_per_problem,
                                                 staleness=cfg.rl.staleness, last=step + 1 == cfg.rl.steps)
        out, sampling = (await dynamic_sampling.fill(out, self.producer, self.data, step, cfg)
                         if cfg.rl.dynamic_sampling.enabled else (out, {}))
        stage = cfg.stage(step)
        solved_now = (solved_ids(out.problems, [s.reward for s in out.scored], self.cfg.rl.rollouts_per_problem,
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
        train_metrics = await self.train(kept, records, out.timeline)
        if processes.is_primary():
            self.traces.write(step, records)  # after the update: a crash before it redoes the step anyway
        self.state = dataclasses.replace(self.state, rl_step=step + 1, version=self.learner.version, stage=stage_i,
                                         data=data, carried=carry.carried_state(self.carried))
        return {"phase": "rl", "step": step, "stage": stage_i,
                **step_metrics(engine, out, len(kept)), **staleness, **sampling, **train_metrics, **out.counts}

    async def prefilter(self, stage_i: int, step: int) -> set[str]:
        """The paper's pre-pass before stage `stage_i` (rl/prefilter.py): the ids the current policy
        solves k/k, dropped for the rest of the run."""
        path = os.path.join(self.workdir, "prefilter", f"stage{stage_i}.jsonl")
        solved = await prefilter_stage(self.producer, self.task.train_problems, self.cfg, stage_i, step, path)
        n = len(self.task.train_problems)
        print(f"stage {stage_i} pre-filter: {len(solved)} of {n} problems solved k/k and dropped, {n - len(solved)} kept")
        self.log.write({"phase": "prefilter", "stage": stage_i, "step": step, "problems": n, "dropped": len(solved)})
        return solved

    async def train(self, kept: list[KeptRollout], records, timeline: Timeline) -> dict[str, float]:
        """One learner update on the kept rollouts (none kept: no update), then the weights to
        the engine; the learner's per-token entropies go into the kept rollouts' records. The
        update runs on a worker thread: rollouts of later steps go on meanwhile (async mode)."""
        if not kept:
            return {}
        rl = self.cfg.rl
        batch = make_batch([k.trajectory.token_ids for k in kept], [k.trajectory.loss_mask for k in kept],
                           [k.trajectory.logprobs for k in kept], [k.advantage for k in kept],
                           pad_multiple=rl.pad_width_multiple, max_len=self.cfg.rollout.max_len,
                           rows_multiple=rl.pad_rows_multiple, max_rows=rl.batch_problems * rl.group_size)
        kl = rl.kl
        with timeline.span("learner"):
            if kl.in_reward:  # the KL to the reference lowers each reward before the group advantage
                seq_kl = (await asyncio.to_thread(self.learner.sequence_kl, batch))[:len(kept)]  # not the padding rows
                batch.advantages[:len(kept)] = advantages_with_kl(kept, seq_kl, kl.coef, rl.advantage)
            metrics = await asyncio.to_thread(self.learner.update, batch)
            if kl.in_reward:
                metrics[f"kl_reward_{kl.estimator}"] = float(np.mean(seq_kl))
        if not self.learner.packs:  # the padded shape the update compiled for (rl.pad_*_multiple)
            metrics["update/rows"], metrics["update/width"] = map(float, batch.tokens.shape)
        if batch.entropy is not None:
            for i, k in enumerate(kept):
                records[k.record]["entropy"] = batch.entropy[i, :len(k.trajectory.token_ids)].tolist()
        engine = self.producer.engine
        with timeline.span("sync"):
            await engine.sync_weights(engine_weights(self.learner, self.cfg, len(self.learner_devices)),
                                      self.learner.version)
        if engine.weights_on_servers:
            metrics["sync/failures"] = engine.failed_syncs  # this session's so far (each was retried at once)
            # the process that pushed: how long the servers stood (sync_wait=export: in the last sync that landed)
            if (paused := engine.sync_paused_s()) is not None:
                metrics["sync/servers_paused_s"] = paused
        return metrics


def run(cfg, workdir: str, *, config_mismatch: str = "stop", before: dict[str, Any] | None = None) -> dict[str, Any]:
    return asyncio.run(RLRun(cfg, workdir, config_mismatch=config_mismatch, before=before).run())
