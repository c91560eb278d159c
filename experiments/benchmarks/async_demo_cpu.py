"""Wall time per RL step of the CPU demo, synchronous (rl.max_staleness=0) against asynchronous
(k = 1, waiting for a step's groups or carrying its slowest into the next), with the embedded
JaxEngine or vLLM CPU servers, on padded or packed learner rows: side by side in one run.

    python -m experiments.benchmarks.async_demo_cpu [--steps 6 --rounds 2] [--schedules 0 1:carry] \
        [--engines jax vllm] [--token_budgets 0 640] [--servers 2] [--record BENCHMARKS.md]

Each run is the demo (experiments/tiny_arith.py) shortened: a brief SFT warm start, then
`--steps` GRPO-RoC steps on the real sandbox, every step updating (groups of equal rewards are
kept: a timing run, not a learning one). A schedule is `k` (rl.max_staleness, policy wait) or
`k:carry` (rl.staleness.policy=carry). The figure is the median of the trainer's
`time/interval_s` (wall time from one step's end to the next, overlap included) over the steps
after the first (which compiles); the learner's share is its median `time/learner_s` over that.
Runs alternate `--rounds` times in one run (a shared machine drifts), one engine's cells after
the other's. With `vllm`, `--servers`
vLLM CPU servers (.venv-vllm, eager, float32) serve the same tiny model and take every sync.
On a CPU the engines, the learner and the sandbox share the same cores, so overlap can only hide
the learner behind tool waits and idle engine slots; on separate devices it also hides the
update itself (the pipeline simulation: scheduler_sim).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile

from experiments import tiny_arith
from experiments.benchmarks import common


def demo_config(steps: int, schedule: str, model_dir: str, engine: str, urls: list[str], token_budget: int):
    k, _, policy = schedule.partition(":")
    c = tiny_arith.get_config()
    c.model.path = model_dir  # one model directory the servers also serve
    c.sft.steps = 60
    c.data.eval_problems = 4
    c.eval.before_and_after = False
    c.rl.steps = steps
    c.rl.batch_problems = 8
    c.rl.max_staleness = int(k)
    c.rl.staleness.policy = policy or "wait"
    c.rl.correction.names = ("token_tis",)  # in every run: carried groups need it, and the cost is the same
    c.rl.token_budget = token_budget
    c.rollout.engine = engine
    if engine == "vllm":
        c.rollout.vllm.urls = urls
    # a short warm start solves little; keeping equal-reward groups makes every step run the
    # update (zero advantages, full cost), which is what this timing needs
    c.rl.roc.reject_uniform_groups = False
    c.checkpoint.every = steps
    return c


def demo_model(prefix: str) -> tuple[str, str]:
    """A fresh directory and the demo's tiny model built in it (one model the runs and servers share)."""
    from rstar2_jax.models import tiny
    base = tiny_arith.get_config().model
    work = tempfile.mkdtemp(prefix=prefix)
    return work, tiny.build_tiny_model(os.path.join(work, "model"), num_layers=base.tiny_layers,
                                       hidden_size=base.tiny_hidden, intermediate_size=3 * base.tiny_hidden)


def one_run(cfg) -> dict[str, float]:
    from rstar2_jax.rl.trainer import run

    with tempfile.TemporaryDirectory() as work:
        run(cfg, work)
        lines = [l for l in map(json.loads, open(os.path.join(work, "metrics.jsonl"))) if l["phase"] == "rl"]
    later = lines[1:]
    interval = statistics.median(l["time/interval_s"] for l in later)
    learner = statistics.median(l["time/learner_s"] for l in later)
    return {"interval_s": interval, "learner_s": learner, "learner_share": learner / interval,
            "staleness_max": max(l["staleness/max"] for l in lines)}


def start_servers(model_dir: str, n: int, work: str):
    from rstar2_jax.rollout.engines.vllm_engine.server import ServerOptions, VLLMServer, free_port
    python = common.vllm_python()
    # every step's prompts in one engine step: vLLM 0.32's CPU build fails a seeded request whose
    # prefill is chunked ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync),
    # and the default 2,048-token budget chunks the 64 prompts of a step
    unchunked = ("--max-num-batched-tokens", "65536")
    servers = [VLLMServer(model_dir, ServerOptions(port=free_port(), dtype="float32", max_model_len=1024,
                                                   cpu_kv_cache_gib=1, eager=True, extra_args=unchunked), python=python,
                          log_path=os.path.join(work, f"server{i}.log")).start() for i in range(n)]
    for s in servers:
        s.wait_ready(timeout=900)
    return servers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--schedules", nargs="*", default=["0", "1:carry"])
    p.add_argument("--engines", nargs="*", default=["jax", "vllm"], choices=("jax", "vllm"))
    p.add_argument("--token_budgets", type=int, nargs="*", default=[0, 640],
                   help="0: padded rows (on a CPU packed rows take XLA attention: keep them near rollout.max_len)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--record")
    args = p.parse_args(argv)
    work, model_dir = demo_model("async_demo_")
    cells = list(itertools.product(args.engines, args.token_budgets, args.schedules))
    results = {cell: [] for cell in cells}
    for engine in args.engines:  # the servers run only for their own cells (idle, they still take CPU)
        servers = start_servers(model_dir, args.servers, work) if engine == "vllm" else []
        try:
            for _ in range(args.rounds):
                for cell in (c for c in cells if c[0] == engine):
                    cfg = demo_config(args.steps, cell[2], model_dir, engine, [s.url for s in servers], cell[1])
                    results[cell].append(one_run(cfg))
                    print(cell, results[cell][-1], flush=True)
        finally:
            for s in servers:
                s.stop()
    med = statistics.median
    rows = []
    for engine, budget, schedule in cells:
        runs = results[engine, budget, schedule]
        sync = med(r["interval_s"] for r in results[engine, budget, args.schedules[0]])
        interval = med(r["interval_s"] for r in runs)
        k, _, policy = schedule.partition(":")
        rows.append((f"{args.servers} vLLM CPU servers" if engine == "vllm" else "JaxEngine (embedded)",
                     f"packed, {budget} tokens" if budget else "padded",
                     "sync (k=0)" if k == "0" else f"async k={k}" + (", carry" if policy else ""),
                     f"{interval:.2f}", f"{sync / interval:.2f}x", f"{med(r['learner_s'] for r in runs):.2f}",
                     f"{100 * med(r['learner_share'] for r in runs):.0f}%",
                     f"{max(r['staleness_max'] for r in runs):.0f}"))
    header = ["rollouts", "learner rows", "schedule", "median s per step", "vs sync (same rollouts and rows)",
              "median learner s", "learner share of a step", "max token staleness"]
    config = (f"experiments/tiny_arith.py with sft.steps=60, rl.batch_problems=8 (64 rollouts per step), "
              f"rl.roc.reject_uniform_groups=False, rl.correction.names=(token_tis,), {args.steps} steps per run "
              f"(first excluded), {args.rounds} alternating rounds; JaxEngine 32 slots, or {args.servers} vLLM CPU "
              "servers (eager, float32, the same tiny model, every sync staged with deferred probes); strict "
              "sandbox, 2 workers")
    command = common.command_line("experiments.benchmarks.async_demo_cpu", argv)
    common.record(args.record, "CPU demo: synchronous vs asynchronous RL steps", command.strip(), config,
                  common.markdown_table(header, rows), group=common.PIPELINE)


if __name__ == "__main__":
    main()
