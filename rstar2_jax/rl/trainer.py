"""The RL run: SFT warm start (optional), then GRPO-RoC steps with the embedded engine and sandbox.

Every step: sample problems -> 2G rollouts each (agent loop, JaxEngine, LocalSandbox) -> rewards
and RoC penalties -> RoC keeps G -> advantages -> learner update (old log-probs recomputed) ->
weights to the engine -> traces (Parquet), metrics (JSONL + TensorBoard), checkpoint (orbax).

Reproducible: every rollout's sampling seed and every RoC draw derive from (config seed, step,
problem, sample), so a run resumed from its last checkpoint continues exactly as it would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm.auto import tqdm

import sandbox as sandbox_lib
from rstar2_jax import models, sharding
from rstar2_jax.data import arith
from rstar2_jax.data.problems import load_problems
from rstar2_jax.learner import Learner, LearnerConfig, LossConfig, make_batch
from rstar2_jax.learner.sft import SFTTrainer, iterate_batches
from rstar2_jax.models import tiny
from rstar2_jax.models.decoder import DECODE_ATTENTION, FULL_ATTENTION
from rstar2_jax.models.tokenizer import Tokenizer
from rstar2_jax.rewards import extract_answer
from rstar2_jax.rl.checkpoints import RunCheckpoints
from rstar2_jax.rl.evaluation import rollout_problems, summarize
from rstar2_jax.rl.grpo_roc import select_group
from rstar2_jax.rollout import AgentConfig, PromptFormat
from rstar2_jax.rollout.engines import JaxEngine
from rstar2_jax.rollout.engines.vllm_engine import VLLMEngine
from rstar2_jax.rollout.scheduler import POLICIES, Scheduler
from rstar2_jax.timeline import Timeline, exclusive_length
from rstar2_jax.traces import TraceWriter, trajectory_record

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ConfigValueError(ValueError):
    pass


def validate(cfg: ml_collections.ConfigDict):
    def need(cond, msg):
        if not cond:
            raise ConfigValueError(f"invalid config: {msg}")
    need(cfg.model.dtype in DTYPES, f"model.dtype must be one of {sorted(DTYPES)}, got {cfg.model.dtype!r}")
    need(cfg.model.attention in FULL_ATTENTION, f"model.attention must be one of {FULL_ATTENTION}, got {cfg.model.attention!r}")
    need(cfg.model.decode_attention in DECODE_ATTENTION,
         f"model.decode_attention must be one of {DECODE_ATTENTION}, got {cfg.model.decode_attention!r}")
    need(cfg.model.decode_attention != "pallas" or cfg.rollout.max_len % 128 == 0,
         f"model.decode_attention=pallas needs rollout.max_len to be a multiple of 128, got {cfg.rollout.max_len}")
    need(cfg.format in ("tiny", "rstar2"), f"format must be tiny or rstar2, got {cfg.format!r}")
    need(cfg.rl.roc.mode in ("paper", "release", "off"), f"rl.roc.mode must be paper, release or off, got {cfg.rl.roc.mode!r}")
    need(cfg.rl.group_size >= 2, "rl.group_size must be >= 2 (advantages need a group)")
    need(cfg.rl.oversample >= 1, "rl.oversample must be >= 1")
    need(cfg.rl.batch_problems >= 1 and cfg.rl.steps >= 0, "rl.batch_problems >= 1 and rl.steps >= 0")
    need(cfg.rollout.max_response_tokens < cfg.rollout.max_len, "rollout.max_response_tokens must be < rollout.max_len")
    r = cfg.rollout
    need(r.get("engine", "jax") in ("jax", "vllm"), f"rollout.engine must be jax or vllm, got {r.get('engine')!r}")
    if r.get("engine", "jax") == "vllm":
        need(len(r.get("vllm_urls", [])) >= 1, "rollout.engine=vllm needs rollout.vllm_urls: the server URLs "
             "(start one with `python -m rstar2_jax.rollout.serve --model DIR`)")
        need(r.get("scheduler", "kv_aware") in POLICIES, f"rollout.scheduler must be one of {sorted(POLICIES)}")
    need(len(cfg.stages) >= 1 and cfg.stages[0]["start_step"] == 0, "stages must start with start_step=0")
    starts = [s["start_step"] for s in cfg.stages]
    need(starts == sorted(starts), "stages must be ordered by start_step")
    need(cfg.data.task == "arith" or os.path.exists(cfg.data.task), f"data.task: no such file {cfg.data.task!r}")
    if cfg.data.task != "arith":
        need(os.path.exists(cfg.data.get("eval_path", "")), "data.eval_path: a JSONL file of evaluation problems")
        need(cfg.sft.steps == 0, "sft.steps must be 0 for JSONL tasks (fine-tune first with python -m rstar2_jax.sft)")


def stable_seed(*parts) -> int:
    """A 31-bit seed from parts, the same in every process (unlike hash() of strings)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") >> 1


def stage_index(cfg, step: int) -> int:
    return max(i for i, s in enumerate(cfg.stages) if s["start_step"] <= step)


class RLRun:
    def __init__(self, cfg: ml_collections.ConfigDict, workdir: str):
        validate(cfg)
        self.cfg, self.workdir = cfg, os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.fmt: PromptFormat = arith.tiny_format() if cfg.format == "tiny" else PromptFormat()
        model_dir = cfg.model.path or os.path.join(self.workdir, "base_model")
        if not cfg.model.path and not os.path.exists(os.path.join(model_dir, "config.json")):
            tiny.build_tiny_model(model_dir, seed=cfg.seed, num_layers=cfg.model.tiny_layers,
                                         hidden_size=cfg.model.tiny_hidden, intermediate_size=3 * cfg.model.tiny_hidden)
        self.model_dir = model_dir
        with open(os.path.join(self.workdir, "run.json"), "w") as f:  # what evaluate --checkpoint loads
            json.dump({"model_dir": os.path.abspath(model_dir), "run_name": cfg.run_name}, f, indent=2)
        with open(os.path.join(self.workdir, "config.json"), "w") as f:  # what the notebooks show
            f.write(cfg.to_json_best_effort(indent=2))
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.model = models.load_pretrained(model_dir, dtype=DTYPES[cfg.model.dtype], param_dtype=jnp.float32)
        self.model.remat = cfg.model.remat
        self.model.set_attention(full=cfg.model.attention, decode=cfg.model.decode_attention)
        if cfg.data.task == "arith":
            self.train_problems = arith.make_problems(cfg.data.train_problems, seed=cfg.seed + 1)
            self.eval_problems = arith.make_problems(cfg.data.eval_problems, seed=10_000 + cfg.seed)
        else:  # JSONL problem sets (problem/answer per line)
            self.train_problems = load_problems(cfg.data.task, limit=cfg.data.train_problems or None)
            self.eval_problems = load_problems(cfg.data.eval_path, limit=cfg.data.eval_problems or None)
        self.checkpoints = RunCheckpoints(os.path.join(self.workdir, "checkpoints"), keep=cfg.checkpoint.keep)
        self.traces = TraceWriter(os.path.join(self.workdir, "traces"))
        self.metrics_path = os.path.join(self.workdir, "metrics.jsonl")
        self.learner: Learner | None = None

    # ------------------------------------------------------------------------------------------
    def agent_config(self, step: int, temperature: float | None = None) -> AgentConfig:
        stage = self.cfg.stages[stage_index(self.cfg, step)]
        r = self.cfg.rollout
        return AgentConfig(format=self.fmt, max_turns=stage["max_turns"], max_response_tokens=stage["max_response_tokens"],
                           temperature=r.temperature if temperature is None else temperature, tool_timeout_s=r.tool_timeout_s)

    def make_engine(self, engine_model):
        """The embedded JaxEngine, or clients of vLLM servers (several: behind the scheduler)."""
        r = self.cfg.rollout
        if r.get("engine", "jax") == "jax":
            return JaxEngine(engine_model, self.tokenizer, slots=r.slots, max_len=r.max_len, seed=self.cfg.seed)
        export_dtype = DTYPES[r.vllm_export_dtype] if r.get("vllm_export_dtype") else None
        engines = [VLLMEngine(url, engine_model, export_dtype=export_dtype,
                              probe_tolerance=r.get("vllm_probe_tolerance", 1e-3))
                   for url in r.vllm_urls]
        return engines[0] if len(engines) == 1 else Scheduler(engines, r.get("scheduler", "kv_aware"))

    def sft(self):
        c = self.cfg.sft
        data = arith.sft_dataset(self.tokenizer, self.fmt, c.examples, seed=self.cfg.seed + 2)
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
            scored = await rollout_problems(engine, sb, self.tokenizer, [p.question for p in probs],
                                            [p.answer for p in probs], self.agent_config(step, temperature), seeds)
            out[name] = summarize(scored)
        self._log({"phase": "eval", "label": label, "step": step, **{f"{k}/{m}": v for k, s in out.items()
                                                                         for m, v in s.items()}})
        return out

    def _log(self, record: dict[str, Any]):
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"time": time.time(), **record}) + "\n")
        if record.get("phase") == "rl" and hasattr(self, "_tb"):
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])

    # ------------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(self.workdir, "tensorboard"))
        cfg = self.cfg
        lcfg = LearnerConfig(lr=cfg.rl.lr, warmup_steps=cfg.rl.warmup_steps, weight_decay=cfg.rl.weight_decay,
                             grad_clip=cfg.rl.grad_clip, token_entropy=cfg.rl.get("token_entropy", True),
                             loss=LossConfig(cfg.rl.loss.name, cfg.rl.loss.eps_low, cfg.rl.loss.eps_high,
                                             cfg.rl.loss.dual_clip, temperature=cfg.rollout.temperature,
                                             micro_batches=cfg.rl.micro_batches))
        latest = self.checkpoints.latest_step()
        self.mesh = None
        if "mesh" in cfg and jax.device_count() > 1:
            self.mesh = sharding.make_mesh(**cfg.mesh)
        self.learner = Learner(self.model, lcfg, mesh=self.mesh)
        meta = {"rl_step": 0, "data_pos": 0, "version": 0, "stage": 0, "results": {}}
        if latest is not None:
            state, meta = self.checkpoints.restore(latest, self.learner.state)
            self.learner.state = state
            self.learner.version = meta["version"]
            print(f"resumed from {self.checkpoints.directory} step {latest}")
        elif cfg.sft.steps > 0:
            params = self.sft()
            self.learner = Learner(self.model_with(params), lcfg, mesh=self.mesh)
            self.checkpoints.save(0, self.learner.state, meta)
        engine_model = self.model_with(self.learner.model_state())
        async with sandbox_lib.LocalSandbox(workers=cfg.sandbox.workers, isolation=cfg.sandbox.isolation) as sb, \
                self.make_engine(engine_model) as engine:
            engine.update_weights(self.learner.model_state(), self.learner.version)
            results = dict(meta.get("results", {}))
            if cfg.eval.before_and_after and "before" not in results:
                results["before"] = await self.evaluate(engine, sb, meta["rl_step"], "before_rl")
                meta["results"] = results
            start = meta["rl_step"]
            bar = tqdm(range(start, cfg.rl.steps), initial=start, total=cfg.rl.steps, desc="GRPO-RoC",
                       dynamic_ncols=True)
            for step in bar:
                metrics, meta = await self.rl_step(engine, sb, step, meta)
                bar.write(format_breakdown(metrics))
                bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", p_err=f"{metrics['p_err_correct']:.2f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
                meta["rl_step"] = step + 1
                meta["results"] = results
                if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.rl.steps:
                    self.checkpoints.save(step + 1, self.learner.state, meta)
            if cfg.eval.before_and_after and "after" not in results:
                results["after"] = await self.evaluate(engine, sb, cfg.rl.steps, "after_rl")
        self._tb.close()
        self.checkpoints.close()
        with open(os.path.join(self.workdir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        return results

    def _next_problems(self, pos: int, skip: set[str]):
        """The next batch of training problems from `pos` (wrapping), skipping `skip` ids."""
        n = len(self.train_problems)
        if len(skip) >= n:
            raise RuntimeError("every training problem has been filtered out as solved")
        batch = []
        while len(batch) < self.cfg.rl.batch_problems:
            p = self.train_problems[pos % n]
            pos = (pos + 1) % n
            if p.id not in skip:
                batch.append(p)
        return batch, pos

    def model_with(self, params):
        """The run's model architecture with `params` (an nnx.State of its Params)."""
        from flax import nnx
        graphdef, _ = nnx.split(self.model, nnx.Param)
        return nnx.merge(graphdef, params)

    async def rl_step(self, engine, sb, step: int, meta: dict[str, Any]):
        cfg = self.cfg
        stage_i = stage_index(cfg, step)
        if stage_i != meta.get("stage", 0):
            if cfg.stages[stage_i]["reset_optimizer"]:
                self.learner.reset_optimizer()
            meta["stage"] = stage_i
        n_roll = cfg.rl.group_size * cfg.rl.oversample
        filter_k = int(cfg.stages[stage_i].get("filter_solved_k", 0) or 0)
        problems, meta["data_pos"] = self._next_problems(meta["data_pos"], set(meta.get("solved", [])) if filter_k else set())
        questions = [p.question for p in problems for _ in range(n_roll)]
        golds = [p.answer for p in problems for _ in range(n_roll)]
        seeds = [stable_seed(cfg.seed, "rollout", step, b, j) for b in range(len(problems)) for j in range(n_roll)]
        step_start = time.monotonic()
        timeline = Timeline()
        take_busy = getattr(engine, "take_busy_intervals", list)  # engines that measure their busy time
        take_busy()  # only this step's work
        stats_before = dataclasses.replace(engine.stats) if hasattr(engine, "stats") else None
        with timeline.activate():
            scored = await rollout_problems(engine, sb, self.tokenizer, questions, golds, self.agent_config(step), seeds)
        rollout_s = time.monotonic() - step_start - timeline.union("reward")
        timeline.extend("engine", take_busy())
        stale = [s for s in scored if s.trajectory.min_version < self.learner.version - cfg.rl.max_staleness]
        if stale:
            raise RuntimeError(f"step {step}: {len(stale)} rollouts are older than the allowed staleness")

        rng = np.random.default_rng([cfg.seed, step])
        rows, records = [], []
        for b, problem in enumerate(problems):
            group = scored[b * n_roll:(b + 1) * n_roll]
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
        if filter_k and n_roll >= filter_k:
            # the stage's data filter: a problem the latest policy solved k/k teaches nothing more
            solved = set(meta.get("solved", []))
            solved.update(p.id for b, p in enumerate(problems)
                          if all(s.reward > 0 for s in scored[b * n_roll:(b + 1) * n_roll]))
            meta["solved"] = sorted(solved)

        train_metrics = {}
        if rows:
            batch = make_batch([t.token_ids for t, _, _ in rows], [t.loss_mask for t, _, _ in rows],
                               [t.logprobs for t, _, _ in rows], [a for _, a, _ in rows], pad_multiple=32,
                               rows_multiple=cfg.rl.micro_batches, max_len=cfg.rollout.max_len)
            with timeline.span("learner"):
                train_metrics = self.learner.update(batch)
            if batch.entropy is not None:  # the learner's per-token entropies, for the analysis
                for i, (t, _, r) in enumerate(rows):
                    records[r]["entropy"] = batch.entropy[i, :len(t.token_ids)].tolist()
            with timeline.span("sync"):
                engine.update_weights(self.learner.model_state(), self.learner.version)
        self.traces.write(step, records)  # after the update: a crash before it redoes the step anyway
        summary = summarize(scored)
        gen_tokens = sum(int(np.sum(s.trajectory.loss_mask)) for s in scored)
        metrics = {
            "phase": "rl", "step": step, "stage": meta["stage"], "reward_mean": summary["accuracy"],
            "p_err_correct": summary["tool_error_ratio_correct"],
            "kept_rollouts": len(rows), "rollout_s": rollout_s, "tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
            "mean_response_tokens": summary["mean_response_tokens"], "mean_tool_calls": summary["mean_tool_calls"],
            **step_breakdown(timeline, rollout_s, time.monotonic() - step_start, stats_before, getattr(engine, "stats", None)),
            **train_metrics,
        }
        self._log(metrics)
        return metrics, meta


def step_breakdown(timeline: Timeline, rollout_s: float, step_s: float, stats_before, stats_after) -> dict[str, float]:
    """Wall-time breakdown of one RL step and how busy the engine was.

    tool_s: wall time with at least one tool call in flight; tool_wait_s: the part of it with
    the engine idle (the pipeline waited on tools); tool_overlap: the share of tool time hidden
    behind generation. engine_busy: share of the rollout the engine spent on device work;
    engine_slot_utilization: share of decode-step slots that held a request (JaxEngine only).
    """
    tool_s = timeline.union("tool")
    tool_wait_s = exclusive_length(timeline.get("tool"), timeline.get("engine"))
    return {
        "time/step_s": step_s, "time/rollout_s": rollout_s, "time/reward_s": timeline.union("reward"),
        "time/learner_s": timeline.union("learner"), "time/sync_s": timeline.union("sync"),
        "time/tool_s": tool_s, "time/tool_wait_s": tool_wait_s,
        "time/tool_wait_share": tool_wait_s / max(rollout_s, 1e-9),
        "time/tool_overlap": 1.0 - tool_wait_s / tool_s if tool_s > 0 else 0.0,
        "engine/busy": timeline.union("engine") / max(rollout_s, 1e-9),
        **({"engine/slot_utilization": stats_after.since(stats_before).slot_utilization}
           if stats_before is not None else {}),
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


def run(cfg, workdir: str) -> dict[str, Any]:
    return asyncio.run(RLRun(cfg, workdir).run())
