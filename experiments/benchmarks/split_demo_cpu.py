"""The CPU demo with the engine on devices of its own against the colocated engine: does it learn
the same? (issue 70 item 5), on 4 fake CPU devices.

    python -m experiments.benchmarks.split_demo_cpu --seeds 0,1,2 [--record BENCHMARKS.md]

One SFT warm start (the demo's, --sft_steps, seed 0, colocated), exported as a model directory;
then from it, per seed, the demo's RL (experiments/tiny_arith.py, --steps, evaluated before and
after on --eval_problems), asynchronous with k = 1 (rl.max_staleness=1), in two placements:
colocated (the learner FSDP over the 4 devices, the engine sharing them) and 2 + 2
(rollout.jax.devices=2: the learner on 2, the engine on the other 2, each sync a device-to-device
reshard). Placements alternate seed by seed. Different meshes round differently, so runs of one
seed part ways after the first update: the comparison is across seeds, the mean and spread of the
last steps' rollout accuracy and of the evaluation's accuracy.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from experiments import tiny_arith  # noqa: E402
from experiments.benchmarks import common  # noqa: E402

PLACEMENTS = {"colocated": 0, "2 + 2": 2}


def warm_start(args, out_dir: str) -> str:
    """The demo's SFT warm start, once, saved as a model directory both placements start from."""
    from rstar2_jax.core.checkpoints import load_run_policy
    from rstar2_jax.models import save_pretrained
    from rstar2_jax.rl.trainer import run

    c = tiny_arith.get_config()
    c.sft.steps, c.rl.steps, c.eval.before_and_after = args.sft_steps, 0, False
    work = os.path.join(out_dir, "sft_run")
    run(c, work)
    info = json.load(open(os.path.join(work, "run.json")))
    return save_pretrained(load_run_policy(work, 0), os.path.join(out_dir, "warm_start"),
                           tokenizer_dir=info["model_dir"])


def demo_config(seed: int, engine_devices: int, model_dir: str, args):
    c = tiny_arith.get_config()
    c.seed = seed
    c.model.path = model_dir
    c.sft.steps = 0
    c.rl.steps = args.steps
    c.rl.max_staleness = 1
    c.rollout.jax.devices = engine_devices
    c.data.eval_problems = args.eval_problems
    c.eval.before_and_after = True
    c.checkpoint.every = args.steps
    return c


def one_run(cfg) -> dict[str, float]:
    from rstar2_jax.rl.trainer import run

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        results = run(cfg, work)
        lines = [json.loads(line) for line in open(os.path.join(work, "metrics.jsonl"))]
    steps = [line for line in lines if line["phase"] == "rl"]
    last = steps[-max(1, len(steps) // 2):]
    return {"accuracy_last_half": statistics.mean(line["accuracy"] for line in last),
            "greedy_after": results["after"]["greedy"]["accuracy"],
            "seconds": time.monotonic() - start}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sft_steps", type=int, default=350, help="the shared warm start's steps (the demo's 350)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval_problems", type=int, default=64)
    p.add_argument("--json", help="also write every run's figures here")
    p.add_argument("--record")
    args = p.parse_args(argv)
    import jax
    if jax.device_count() != 4:
        raise SystemExit(f"needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4), got {jax.device_count()}")
    runs: dict[str, list[dict]] = {name: [] for name in PLACEMENTS}
    model_dir = warm_start(args, tempfile.mkdtemp())
    print(f"warm start: {model_dir}", flush=True)
    for seed in map(int, args.seeds.split(",")):
        for name, engine_devices in PLACEMENTS.items():
            r = one_run(demo_config(seed, engine_devices, model_dir, args))
            runs[name].append(dict(seed=seed, **r))
            print(f"{name} seed {seed}: {r}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(runs, f, indent=1)

    def spread(name, key):
        values = [r[key] for r in runs[name]]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.3f} ± {sd:.3f} ({', '.join(f'{v:.3f}' for v in values)})"

    rows = [[name, spread(name, "accuracy_last_half"), spread(name, "greedy_after"),
             f"{statistics.mean(r['seconds'] for r in runs[name]):.0f}"] for name in PLACEMENTS]
    table = common.markdown_table(["placement", "rollout accuracy, last half of the steps (mean ± sd; per seed)",
                                   "greedy accuracy after (mean ± sd; per seed)", "run s (mean)"], rows)
    common.record(args.record, "CPU demo: the engine on devices of its own against colocated, asynchronous k=1 "
                  "(issue 70)", "python -m experiments.benchmarks.split_demo_cpu " + " ".join(
                      argv if argv is not None else sys.argv[1:]),
                  f"tiny_arith: one shared SFT warm start of {args.sft_steps} steps, then {args.steps} RL steps, "
                  f"rl.max_staleness=1, "
                  f"greedy evaluation on {args.eval_problems} problems; 4 fake CPU devices; seeds {args.seeds}", table,
                  group=common.PIPELINE)


if __name__ == "__main__":
    main()
