"""The pipeline model (scheduler_sim) against the CPU demo it models: fed the demo's own measured
costs, does it predict the demo's synchronous and asynchronous steps? (issue 81)

    python -m experiments.benchmarks.pipeline_check [--steps 6] [--schedules 0 1:carry] [--record BENCHMARKS.md]

Runs the shortened CPU demo of async_demo_cpu (the embedded JaxEngine, padded rows) once per
schedule, then reads from each run what the model takes as given:

    decode step     the engine's busy time over its decode steps (tokens / (slot share x slots))
    workload        every rollout's prompt, model tokens per turn and tool latencies (its traces)
    tool output     tokens a tool response adds (response tokens - model tokens, per call)
    learner         seconds per trained token: the update's time over the kept rollouts' tokens
    sync            the step's sync time (the JaxEngine takes its weights in place)

and simulates that workload on one engine of `rollout.jax.slots` requests with those costs, for
the same schedule and number of steps. The figure compared is the median step (the trainer's
`time/interval_s` after the first step; the model's steady step).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

import numpy as np

from experiments.benchmarks import common

# What the model assumes that no measurement here backs (reported with the table).
ASSUMPTIONS = (
    "the engine's decode step costs the same whatever its batch and context (fitted as one mean: "
    "step_per_seq_s = step_per_kv_token_s = 0), with prefill folded into it (prefill_per_token_s = 0)",
    "the learner and the engine never share compute: an update beside rollouts runs at its "
    "synchronous speed (on this CPU both run on the same 2 cores: contradicted by the async figure)",
    "a tool call's latency does not depend on how many run at once (each rollout's own measured "
    "latencies, replayed)",
    "the learner's time is linear in the trained tokens (one measured rate, whatever the row widths)",
)


def measured_costs(work: str, slots: int) -> dict:
    """What the model takes from one run directory (its metrics.jsonl and traces)."""
    from rstar2_jax.traces import read_traces
    lines = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
    rl = [m for m in lines if m.get("phase") == "rl"][1:]  # the first compiles
    med = statistics.median
    tokens = [m["tokens_per_s"] * m["time/rollout_s"] for m in rl]
    decode_steps = [t / (m["engine/slot_utilization"] * slots) for t, m in zip(tokens, rl)]
    step_s = med(m["time/rollout_s"] * m["engine/busy"] / n for m, n in zip(rl, decode_steps))
    traces_dir = os.path.dirname(sorted(glob.glob(os.path.join(work, "**", "step_*.parquet"), recursive=True))[0])
    traces = read_traces(traces_dir)
    workload, tool_tokens, calls = [], 0, 0
    for _, r in traces.iterrows():
        turns = [int(t["num_tokens"]) for t in r["turns"]]
        tools = [float(tool["latency_s"]) for t in r["turns"][:-1] for tool in t["tools"][:1]]
        tools += [0.0] * (len(turns) - 1 - len(tools))
        workload.append((int(r["prompt_len"]), tuple(turns), tuple(tools)))
        tool_tokens += int(r["num_response_tokens"]) - sum(turns)
        calls += len(turns) - 1
    kept = traces[traces["kept"]]
    kept_by_step = kept.groupby("step")["token_ids"].apply(lambda ids: sum(len(x) for x in ids))
    learner_per_token = med(m["time/learner_s"] / kept_by_step[m["step"]] for m in rl if m["step"] in kept_by_step)
    return dict(decode_step_s=step_s, workload=tuple(workload), tool_response_tokens=tool_tokens / max(calls, 1),
                learner_s_per_token=learner_per_token, sync_s=med(m["time/sync_s"] for m in rl),
                kept_fraction=len(kept) / len(traces), interval_s=med(m["time/interval_s"] for m in rl),
                rollout_s=med(m["time/rollout_s"] for m in rl), learner_s=med(m["time/learner_s"] for m in rl),
                tool_mean_s=float(np.mean([t for w in workload for t in w[2]] or [0.0])))


def predicted(costs: dict, schedule: str, steps: int, rollouts: int, group_size: int, slots: int,
              carry_fraction: float) -> dict:
    from experiments.benchmarks.scheduler_sim import SimConfig, simulate
    k, _, policy = schedule.partition(":")
    cfg = SimConfig(engines=1, rollouts=rollouts, measured_workload=costs["workload"], max_running=slots,
                    kv_capacity_tokens=10 ** 9, step_base_s=costs["decode_step_s"], step_per_seq_s=0.0,
                    step_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                    tool_response_tokens=round(costs["tool_response_tokens"]),
                    learner_s_per_token=costs["learner_s_per_token"], kept_fraction=costs["kept_fraction"],
                    sync="colocated", colocated_sync_s=costs["sync_s"], group_size=group_size,
                    carry_fraction=carry_fraction if policy == "carry" else 1.0, affinity=True)
    runs = [simulate(cfg, "kv_aware", seed, steps, int(k)) for seed in range(3)]
    return {key: float(np.mean([r[key] for r in runs])) for key in ("steady_step_s", "rollout_s", "learner_s")}


def main(argv=None):
    from experiments.benchmarks.async_demo_cpu import demo_config, demo_model
    from rstar2_jax.rl.trainer import run

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--schedules", nargs="*", default=["0", "1:carry"])
    p.add_argument("--record")
    args = p.parse_args(argv)
    root, model_dir = demo_model("pipeline_check_")
    rows, measured = [], {}
    # the first schedule again with the learner's separate old-log-prob pass: the share of the
    # demo's step the one pass saves, measured end to end
    runs = [(schedule, "auto") for schedule in args.schedules] + [(args.schedules[0], "separate")]
    for schedule, old_logprobs in runs:
        cfg = demo_config(args.steps, schedule, model_dir, "jax", [], 0)
        cfg.rl.old_logprobs = old_logprobs
        work = os.path.join(root, schedule.replace(":", "_") + "_" + old_logprobs)
        run(cfg, work)
        slots, rl = cfg.rollout.jax.slots, cfg.rl
        costs = measured_costs(work, slots)
        measured.setdefault(schedule, {})[old_logprobs] = costs
        print(schedule, old_logprobs, {k: v for k, v in costs.items() if k != "workload"}, flush=True)
        # each schedule predicted from the synchronous run's costs (nothing overlaps there) and from its
        # own; the separate-pass run (another learner) from its own alone
        sources = {"the sync run's": measured[args.schedules[0]]["auto"], "its own run's": costs}
        if old_logprobs == "separate" or costs is sources["the sync run's"]:
            sources = {"its own run's" if old_logprobs == "separate" else "the sync run's": costs}
        for source, c in sources.items():
            pred = predicted(c, schedule, args.steps, rl.batch_problems * rl.group_size * rl.oversample,
                             rl.group_size * rl.oversample, slots, rl.staleness.carry_fraction)
            name = "sync (k=0)" if schedule == "0" else f"async k={schedule.replace(':', ', ')}"
            rows.append((name + (", separate old-log-prob pass" if old_logprobs == "separate" else ""), source,
                         f"{costs['interval_s']:.2f}", f"{pred['steady_step_s']:.2f}",
                         f"{pred['steady_step_s'] / costs['interval_s']:.2f}", f"{costs['rollout_s']:.2f}",
                         f"{pred['rollout_s']:.2f}", f"{costs['learner_s']:.2f}", f"{pred['learner_s']:.2f}"))
            print(rows[-1], flush=True)
    sync, separate = measured[args.schedules[0]]["auto"], measured[args.schedules[0]]["separate"]
    saved = separate["interval_s"] - sync["interval_s"]
    header = ["schedule", "model fed with", "measured s per step (median)", "predicted s per step",
              "predicted / measured", "measured rollout s", "predicted rollout s", "measured learner s",
              "predicted learner s"]
    config = (f"experiments/tiny_arith.py shortened as async_demo_cpu (sft.steps=60, 64 rollouts a step, JaxEngine "
              f"32 slots, padded rows, token_tis), {args.steps} RL steps a run (the first excluded); measured in "
              f"the sync run: decode step {sync['decode_step_s'] * 1e3:.1f} ms, learner "
              f"{sync['learner_s_per_token'] * 1e6:.1f} us a trained token, sync {sync['sync_s']:.2f} s, tool "
              f"latency {sync['tool_mean_s'] * 1e3:.0f} ms a call (mean), {sync['tool_response_tokens']:.0f} tokens a "
              f"tool response, {len(sync['workload'])} measured rollouts replayed; the model: scheduler_sim with one "
              "engine of 32 running requests, 3 seeds")
    notes = (f"The learner's one pass in the demo's {'sync' if args.schedules[0] == '0' else args.schedules[0]} step: "
             f"{separate['interval_s']:.2f} s a step with the separate pass (its learner {separate['learner_s']:.2f} s), "
             f"{sync['interval_s']:.2f} s in one pass (learner {sync['learner_s']:.2f} s): {saved:.2f} s, "
             f"{saved / separate['interval_s']:.0%} of the step.\n\n"
             "Assumed by the model, backed by no measurement here:\n" + "\n".join(f"- {a}" for a in ASSUMPTIONS))
    common.record(args.record, "RL pipeline model against the CPU demo it models (issue 81)",
                  common.command_line("experiments.benchmarks.pipeline_check", argv).strip(), config,
                  common.markdown_table(header, rows), notes, group=common.PIPELINE)


if __name__ == "__main__":
    main()
