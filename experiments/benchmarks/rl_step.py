"""A whole colocated RL step on one device, phase by phase, against what the pipeline model
predicts for it (issue 70 item 5).

    python -m experiments.benchmarks.rl_step --shape qwen3_0p6b [--steps 3] [--record BENCHMARKS.md]
    python -m experiments.benchmarks.rl_step --shape tiny --sft_steps 40 --steps 2   # a CPU rehearsal

The run is the demo's recipe (experiments/tiny_arith.py: SFT warm start, then GRPO-RoC) on a
model of a public checkpoint's shape (rstar2_jax.models.shapes: layers, widths, heads and the
vocabulary; random weights, the demo's byte tokenizer) in `--dtype`, the JaxEngine with
`--decode_attention` on the learner's device (colocated, synchronous), the local sandbox workers
running every tool call the policy writes, and the update on packed rows (rl.token_budget) of
G of the 2G rollouts of every group (rl.roc.reject_uniform_groups off: a group whose rewards are
all equal still trains, with zero advantages, so each step's update is the same amount of work).
The SFT warm start is what makes the random model write code and answers; its rollouts are the
task's lengths (a few hundred tokens), not the 14B recipe's thousands.

Reported, per RL step (step 0 also compiles): the step's wall time, each phase's time and share
(rollout, reward, learner, sync; tools overlapped with generation), how busy the engine was
(`engine/busy`: share of the rollout with a request of the step on the engine; slot utilization)
and the learner's MFU on the tokens it trained (8 x parameters a token: forward, backward and the
old-log-prob pass, over `--peak_tflops`). The prediction is the pipeline model's
(scheduler_sim.simulate, synchronous colocated, one engine and one learner device) for this run's
own workload, read from its traces: rollouts, prompt tokens, model tokens per turn (log-normal
fit), tool calls, tool-response tokens, the tool calls' latency; its engine costs from the shape and the device (a decode
step reads the bf16 weights and each sequence's KV at `--hbm_gb_s`, a prefill token costs 2 x
parameters at 40% of the peak), the learner at the model's 40% MFU, the sync in place (0 s).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import tempfile

import numpy as np

from experiments import tiny_arith
from experiments.benchmarks import common
from experiments.benchmarks.scheduler_sim import SimConfig, simulate

PHASES = (("rollout", "time/rollout_s"), ("reward", "time/reward_s"), ("learner", "time/learner_s"),
          ("sync", "time/sync_s"))


def run_config(args, model_dir: str):
    """The demo's recipe on `model_dir`, colocated and synchronous, packed update."""
    c = tiny_arith.get_config()
    c.model.path = model_dir
    c.model.dtype = args.dtype
    c.model.decode_attention = args.decode_attention
    c.sft.steps = args.sft_steps
    c.sft.lr = args.sft_lr
    c.rl.steps = args.steps
    c.rl.batch_problems = args.batch_problems
    c.rl.token_budget = args.token_budget
    c.rl.micro_batches = 1
    c.rl.roc.reject_uniform_groups = False  # every step trains G of 2G rollouts, whatever their rewards
    c.rollout.jax.slots = args.slots
    c.eval.before_and_after = False
    c.checkpoint.every = 10 ** 6  # the step's time, not a checkpoint's
    return c


def build_model(shape_name: str, model_dir: str) -> str:
    """A random model of the shape with the demo's tokenizer (its vocabulary is the shape's: the
    tokenizer's ids are its first ones)."""
    from rstar2_jax.models import shapes, tiny

    fields = dict(shapes.SHAPES[shape_name], max_position_embeddings=4096)
    fields["vocab_size"] = max(fields["vocab_size"], tiny.tiny_config().vocab_size)
    return tiny.build_tiny_model(model_dir, seed=0, **fields)


def read_workload(run_dir: str) -> list[dict]:
    """Per RL step, what the pipeline model needs of its rollouts, from the step's traces."""
    import pyarrow.parquet as pq

    steps = []
    for path in sorted(glob.glob(os.path.join(run_dir, "traces", "step_*.parquet"))):
        t = pq.read_table(path, columns=["prompt_len", "num_response_tokens", "loss_mask", "num_tool_calls",
                                         "turns"]).to_pylist()
        latencies = [tool["latency_s"] for r in t for turn in r["turns"] for tool in turn["tools"]]
        model = np.array([sum(r["loss_mask"]) for r in t], float)
        calls = np.array([r["num_tool_calls"] for r in t], float)
        tool_tokens = np.array([r["num_response_tokens"] for r in t], float) - model
        per_turn = np.maximum(model / (calls + 1), 1.0)
        steps.append({"rollouts": len(t), "prompt_tokens": float(np.mean([r["prompt_len"] for r in t])),
                      "turn_median": float(np.exp(np.mean(np.log(per_turn)))),
                      "turn_sigma": float(np.std(np.log(per_turn))), "mean_tool_calls": float(calls.mean()),
                      "tool_response_tokens": float(tool_tokens.sum() / max(calls.sum(), 1.0)),
                      "tool_mean_s": float(np.mean(latencies)) if latencies else 0.0})
    return steps


def predicted(workload: dict, args, params: float, kv_bytes: float, stage: dict, max_len: int,
              kept_fraction: float) -> dict:
    """The pipeline model's synchronous colocated step on one device, for this workload under the
    run's stage (response budget, turns) and KV rows of `max_len` positions per slot."""
    hbm = args.hbm_gb_s * 1e9
    peak = args.peak_tflops * 1e12
    cfg = SimConfig(engines=1, rollouts=workload["rollouts"], prompt_tokens=round(workload["prompt_tokens"]),
                    budget_tokens=stage["max_response_tokens"], mean_tool_calls=workload["mean_tool_calls"],
                    max_turns=stage["max_turns"],
                    turn_tokens_median=workload["turn_median"], turn_tokens_sigma=max(workload["turn_sigma"], 1e-3),
                    tool_response_tokens=round(workload["tool_response_tokens"]), tool_mean_s=max(workload["tool_mean_s"], 1e-3),
                    tool_timeout_share=0.0, kv_capacity_tokens=args.slots * max_len,
                    step_base_s=2 * params / hbm, step_per_seq_s=args.per_sequence_us * 1e-6,
                    step_per_kv_token_s=kv_bytes / hbm, prefill_per_token_s=2 * params / (0.4 * peak),
                    reserve_new_tokens=1024, affinity=True, params=params, learner_devices=1, learner_mfu=0.4,
                    peak_flops=peak, kept_fraction=kept_fraction, sync="colocated", colocated_sync_s=0.0)
    runs = [simulate(cfg, "kv_aware", seed, 1, 0) for seed in range(3)]
    return {k: float(np.mean([r[k] for r in runs])) for k in ("step_s", "rollout_s", "learner_s")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3_0p6b", help="a public checkpoint's shape (rstar2_jax.models.shapes)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--decode_attention", default="pallas", help="xla | pallas")
    p.add_argument("--sft_steps", type=int, default=350, help="the demo's warm start")
    p.add_argument("--sft_lr", type=float, default=2e-3, help="the demo's (for its 2-layer model)")
    p.add_argument("--steps", type=int, default=3, help="RL steps (the first also compiles)")
    p.add_argument("--batch_problems", type=int, default=16, help="x 4 x 2 rollouts a step")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--token_budget", type=int, default=-1, help="packed rows (-1: the memory plan's)")
    p.add_argument("--hbm_gb_s", type=float, default=4800.0, help="prediction: memory bandwidth (H200 datasheet)")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="bf16 dense peak (H100/H200 datasheet)")
    p.add_argument("--per_sequence_us", type=float, default=2.5,
                   help="prediction: a sequence's share of a decode step (H200: the 0.6B's fp32 sampling pass, "
                        "0.324 ms for 128 rows)")
    p.add_argument("--workdir", help="keep the run here (default: a temporary directory)")
    p.add_argument("--record")
    args = p.parse_args(argv)

    from rstar2_jax.models import flops, shapes
    from rstar2_jax.rl.trainer import run

    common.enable_compile_cache()
    work = args.workdir or tempfile.mkdtemp(prefix="rl_step_")
    model_dir = build_model(args.shape, os.path.join(work, "model"))
    cfg = run_config(args, model_dir)
    run_dir = os.path.join(work, "run")
    run(cfg, run_dir)
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [m for m in lines if m.get("phase") == "rl"]
    workloads = read_workload(run_dir)
    arch = shapes.shape(args.shape)
    params = float(flops.param_count(arch))
    kv_bytes = float(flops.kv_bytes_per_token(arch))
    stage = cfg.stages[0]
    budget = stage["max_response_tokens"]
    header = ["step", "step s", *[f"{name} s (share)" for name, _ in PHASES], "tools s (overlapped)",
              "engine busy", "slots used", "rollouts", "response tokens (mean)", "tool calls (mean)",
              "packed rows", "learner MFU", "predicted step s (rollout + learner)", "measured / predicted"]
    rows = []
    for m, w in zip(steps, workloads):
        step_s = m["time/step_s"]
        trained = m.get("tokens", 0.0) * m.get("optimizer_steps", 0.0)
        mfu = 8 * params * trained / max(m["time/learner_s"], 1e-9) / (args.peak_tflops * 1e12)
        pred = predicted(w, args, params, kv_bytes, stage, cfg.rollout.max_len, 1 / cfg.rl.oversample)
        rows.append([m["step"], f"{step_s:.2f}",
                     *[f"{m[key]:.2f} ({m[key] / step_s:.0%})" for _, key in PHASES],
                     f"{m['time/tool_s']:.2f} ({m['time/tool_overlap']:.0%})", f"{m['engine/busy']:.0%}",
                     f"{m.get('engine/slot_utilization', math.nan):.0%}", w["rollouts"],
                     f"{m['mean_response_tokens']:.0f}", f"{m['mean_tool_calls']:.2f}", f"{m.get('packed_rows', 0):.0f}",
                     f"{mfu:.1%}", f"{pred['step_s']:.2f} ({pred['rollout_s']:.2f} + {pred['learner_s']:.2f})",
                     f"{step_s / pred['step_s']:.2f}x"])
        print(dict(zip(header, rows[-1])), flush=True)
    table = common.markdown_table(header, rows)  # common.record prints it
    config = (f"{args.shape} shape ({params / 1e6:,.1f}M parameters, random weights, the demo's byte tokenizer), "
              f"{args.dtype}, decode attention {args.decode_attention}, {args.slots} slots; tiny_arith: SFT "
              f"{args.sft_steps} steps at lr {args.sft_lr}, then {args.steps} RL steps of {args.batch_problems} problems x "
              f"{cfg.rl.group_size} x {cfg.rl.oversample} rollouts, responses <= {budget} tokens, local sandbox "
              f"workers, rl.token_budget={args.token_budget}; learner MFU on trained tokens at 8 x parameters over "
              f"{args.peak_tflops:.0f} TFLOP/s; prediction: scheduler_sim, one engine + one learner device, this "
              f"run's workload, {args.hbm_gb_s:.0f} GB/s, learner 40% MFU")
    common.record(args.record, "A whole colocated RL step on one device (issue 70)",
                  common.command_line("experiments.benchmarks.rl_step", argv), config, table, group=common.PIPELINE)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
