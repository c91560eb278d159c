"""Wall time per RL step of the CPU demo, synchronous (rl.max_staleness=0) against asynchronous
(k = 1, 2) rollouts.

    python -m experiments.benchmarks.async_demo_cpu [--steps 6 --rounds 2] [--record BENCHMARKS.md]

Each run is the demo (experiments/tiny_arith.py) shortened: a brief SFT warm start, then
`--steps` GRPO-RoC steps on the real sandbox with the JaxEngine, every step updating (groups of
equal rewards are kept: a timing run, not a learning one). The figure is the median of the
trainer's `time/interval_s` (wall time from one step's end to the next, overlap included) over
the steps after the first (which compiles). Schedules alternate `--rounds` times in one run
(a shared machine drifts). On a CPU the engine, the learner and the sandbox share the same cores,
so overlap can only hide the learner behind tool waits and idle engine slots; on separate
devices it also hides the update itself (the pipeline simulation: scheduler_sim --pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from experiments import tiny_arith
from experiments.benchmarks import common


def demo_config(steps: int, max_staleness: int):
    c = tiny_arith.get_config()
    c.sft.steps = 60
    c.data.eval_problems = 4
    c.eval.before_and_after = False
    c.rl.steps = steps
    c.rl.batch_problems = 8
    c.rl.max_staleness = max_staleness
    # a short warm start solves little; keeping equal-reward groups makes every step run the
    # update (zero advantages, full cost), which is what this timing needs
    c.rl.roc.reject_uniform_groups = False
    c.checkpoint.every = steps
    return c


def one_run(steps: int, k: int) -> dict[str, float]:
    from rstar2_jax.rl.trainer import run

    with tempfile.TemporaryDirectory() as work:
        run(demo_config(steps, k), work)
        lines = [l for l in map(json.loads, open(os.path.join(work, "metrics.jsonl"))) if l["phase"] == "rl"]
    later = lines[1:]
    return {"interval_s": statistics.median(l["time/interval_s"] for l in later),
            "learner_s": statistics.median(l["time/learner_s"] for l in later),
            "staleness_max": max(l["staleness/max"] for l in lines)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--staleness", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--record")
    args = p.parse_args(argv)
    results = {k: [] for k in args.staleness}
    for _ in range(args.rounds):
        for k in args.staleness:
            results[k].append(one_run(args.steps, k))
            print(k, results[k][-1], flush=True)
    base = statistics.median(r["interval_s"] for r in results[args.staleness[0]])
    rows = []
    for k, runs in results.items():
        interval = statistics.median(r["interval_s"] for r in runs)
        rows.append(("sync (k=0)" if k == 0 else f"async k={k}", f"{interval:.2f}", f"{base / interval:.2f}x",
                     f"{statistics.median(r['learner_s'] for r in runs):.2f}",
                     f"{max(r['staleness_max'] for r in runs):.0f}"))
    header = ["schedule", "median s per step", "vs sync", "median learner s", "max token staleness"]
    config = (f"experiments/tiny_arith.py with sft.steps=60, rl.batch_problems=8 (64 rollouts per step), "
              f"rl.roc.reject_uniform_groups=False, {args.steps} "
              f"steps per run (first excluded), {args.rounds} alternating rounds; JaxEngine 32 slots, strict sandbox, 2 workers")
    command = common.command_line("experiments.benchmarks.async_demo_cpu", argv)
    common.record(args.record, "CPU demo: synchronous vs asynchronous RL steps", command.strip(), config,
                  common.markdown_table(header, rows))


if __name__ == "__main__":
    main()
