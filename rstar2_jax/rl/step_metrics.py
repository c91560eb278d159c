"""A step's metrics and where they go: metrics.jsonl and the trackers (MetricsLog), the per-step
table of rollout metrics, wall-time breakdown and engine counters, and the console lines."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from rstar2_jax.core import processes
from rstar2_jax.rl.step_rollouts import StepRollouts
from rstar2_jax.rollout.scoring import summarize
from rstar2_jax.core.timeline import Timeline, exclusive_length, overlap_length


class MetricsLog:
    """metrics.jsonl (always), and the trackers of `logging.backends` (rstar2_jax/trackers): RL
    steps under their names, SFT steps under sft/, the before/after evaluations under
    eval/<label>/ (at the RL step they ran at); the same names in every one. Primary process
    only; the trackers are opened on first use (a re-run with nothing to log opens none)."""

    def __init__(self, workdir: str, settings=None, run_name: str = "", config: dict | None = None):
        from rstar2_jax.trackers import LoggingConfig, TrackerSet
        self.workdir = workdir
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.trackers = TrackerSet(workdir, settings if settings is not None else LoggingConfig(), run_name, config)

    def write(self, record: dict[str, Any]):
        if not processes.is_primary():
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": time.time(), **record}) + "\n")
        phase = record.get("phase")
        prefix = {"rl": "", "sft": "sft/", "eval": f"eval/{record.get('label', '')}/"}.get(phase)
        if prefix is None:
            return
        self.trackers.log({prefix + k: v for k, v in record.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"},
                          record["step"], axis="sft" if phase == "sft" else "rl")

    def resume_at(self, checkpoint_step: int | None, done: set[str]):
        """metrics.jsonl as of the checkpoint a run resumes from: the rows of the work it runs
        again are dropped (rows_kept_at_resume), so every step is in the file once however often
        the run was interrupted or killed. The trackers are not rewritten (a replayed step is
        logged to them again at its own step number)."""
        if not processes.is_primary() or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        kept = rows_kept_at_resume(rows, checkpoint_step, done)
        if len(kept) == len(rows):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def text(self, name: str, text: str, step: int):
        if processes.is_primary():
            self.trackers.text(name, text, step)

    def close(self):
        self.trackers.close()


# An evaluation's label in metrics.jsonl and its key in the run's results (RunState.results).
EVAL_RESULT_KEYS = {"before_rl": "before", "after_rl": "after"}


def rows_kept_at_resume(rows: list[dict], checkpoint_step: int | None, done: set[str]) -> list[dict]:
    """The metrics.jsonl rows a run resuming from checkpoint `checkpoint_step` (the RL steps it
    holds: 0..checkpoint_step - 1 trained; None: no checkpoint, SFT and everything after it run
    again) keeps: SFT's (done before the first checkpoint), the RL steps the checkpoint holds,
    evaluations before it or whose results the run keeps (`done`: the keys of its results), and
    rows of any other kind."""
    def kept(row):
        phase, step = row.get("phase"), row.get("step", 0)
        if phase not in ("sft", "rl", "eval"):
            return True
        if checkpoint_step is None:
            return False
        if phase == "rl":
            return step < checkpoint_step
        if phase == "eval":
            # eval.every's evaluations are keyed by their label (step_<N>) in the run's results
            return step < checkpoint_step or EVAL_RESULT_KEYS.get(row.get("label"), row.get("label")) in done
        return True
    return [r for r in rows if kept(r)]


def step_metrics(engine, out: StepRollouts, kept: int) -> dict[str, float]:
    """The step's rollout metrics (the shared METRICS of rollout/scoring.py), throughput, time
    breakdown and engine counters: all of them of the step's own requests (with asynchronous
    rollouts the engine serves several steps at once; engines/accounting.py)."""
    summary = summarize(out.scored)
    # the tokens sampled in this step's rollout time: those a resumed rollout had before the crash
    # (its journal's) are not (a replayed step reported ~300,000 tokens/s)
    gen_tokens = sum(int(np.sum(s.trajectory.loss_mask)) - s.trajectory.meta.get("journal_model_tokens", 0)
                     for s in out.scored)
    step_s = time.monotonic() - out.started
    work = out.work
    queries = work.prefix_cache_queries if work is not None else 0
    cache = ({"engine/prefix_cache_hit_rate": work.prefix_cache_hits / queries}
             if queries > 0 else {})  # servers that report each request's cached prompt tokens (vLLM)
    return {
        **summary,  # the shared METRICS (rollout/scoring.py; README's metric table), over the step's rollouts
        "kept_rollouts": kept, "rollout_s": out.rollout_s, "tokens_per_s": gen_tokens / max(out.rollout_s, 1e-9),
        **step_breakdown(out.timeline, out.rollout_s, step_s, work.stats if work is not None else None), **cache,
    }


def step_breakdown(timeline: Timeline, rollout_s: float, step_s: float, stats) -> dict[str, float]:
    """Wall-time breakdown of one RL step and how busy the engine was.

    Every figure is of the step's own requests: the timeline's "engine" spans are the engine's
    work on them (device calls that served at least one; for servers, their requests in flight)
    and `stats` their counters (accounting.OwnedWork.stats; None for engines without them).

    tool_s: wall time with at least one of the step's tool calls in flight; tool_wait_s: the part
    of it with none of the step's requests being computed (the step waited on tools);
    tool_overlap: the share of tool time hidden behind the step's own generation. engine/busy:
    share of the rollout the engine spent on the step's requests; engine/slot_utilization: share
    of slots busy (anyone's requests) in the decode steps that served the step; engine/own_slot_share:
    the step's own share of those busy slots; engine/prefill_tokens, reused_tokens, preemptions: the
    step's prompt tokens run at admission, prompt tokens whose KV was kept from the previous turn,
    its requests preempted for pages.
    """
    tool_s = timeline.union("tool")
    tool_wait_s = exclusive_length(timeline.get("tool"), timeline.get("engine"))
    return {
        "time/step_s": step_s, "time/rollout_s": rollout_s, "time/reward_s": timeline.union("reward"),
        "time/learner_s": timeline.union("learner"), "time/sync_s": timeline.union("sync"),
        "time/tool_s": tool_s, "time/tool_wait_s": tool_wait_s,
        "time/tool_wait_share": tool_wait_s / max(rollout_s, 1e-9),
        "time/tool_overlap": 1.0 - tool_wait_s / tool_s if tool_s > 0 else 0.0,
        "engine/busy": overlap_length(timeline.get("engine"), timeline.get("request")) / max(rollout_s, 1e-9),
        **({"engine/slot_utilization": stats.slot_utilization,
            "engine/own_slot_share": stats.own_slot_steps / max(stats.busy_slot_steps, 1),
            "engine/prefill_tokens": stats.prefill_tokens, "engine/reused_tokens": stats.reused_tokens,
            "engine/preemptions": stats.preemptions}
           if stats is not None and stats.decode_steps + stats.prefill_tokens > 0 else {}),
    }


def format_breakdown(m: dict[str, float]) -> str:
    slots = f", slots {m['engine/slot_utilization']:.0%}" if "engine/slot_utilization" in m else ""
    return (f"step {m['step']}: {m['time/step_s']:.1f}s = rollout {m['time/rollout_s']:.1f}s (engine busy "
            f"{m['engine/busy']:.0%}{slots}; tools {m['time/tool_s']:.1f}s, "
            f"{m['time/tool_overlap']:.0%} overlapped, wait {m['time/tool_wait_s']:.2f}s) + reward "
            f"{m['time/reward_s']:.2f}s + learner {m['time/learner_s']:.1f}s + sync {m['time/sync_s']:.2f}s")


def format_results(results: dict[str, Any]) -> str:
    rows = [("", "accuracy greedy", "accuracy sampled", "format failures (sampled)", "tool-error ratio (correct)",
             "tool calls", "response tokens")]
    for label in ("before", "after"):
        if label in results:
            g, s = results[label]["greedy"], results[label]["sampled"]
            failures = f"{s['format_failure_rate']:.1%}" if "format_failure_rate" in s else "-"  # older results: -
            rows.append((f"{label} RL", f"{g['accuracy']:.1%}", f"{s['accuracy']:.1%}", failures,
                         f"{s['tool_error_ratio_correct']:.3f}", f"{s['mean_tool_calls']:.2f}",
                         f"{s['mean_response_tokens']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
