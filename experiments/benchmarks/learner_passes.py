"""The learner's update with a separate old-log-prob pass against one pass (issue 81), side by side.

    python -m experiments.benchmarks.learner_passes [--shapes demo,wide] [--rounds 3] [--demo_metrics M]
        [--record BENCHMARKS.md]

For each model shape and row layout (padded rows; packed rows at the longest rollout), two
learners from the same weights, rl.old_logprobs=separate and rl.old_logprobs=auto (one pass, the
default for one optimizer step), update the same batches, alternating within each round, after
one update each that compiles. Reported: the median update (the separate pass included, as
`Learner.update` runs it), the ratio one pass / separate of the same rounds, and the largest
difference of their steps (the same batch, the same weights: rounding only).

`--demo_metrics`: a CPU demo run's metrics.jsonl (make demo writes runs/tiny_arith/metrics.jsonl):
the share of its median RL step the demo shape's saving is.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from experiments.benchmarks import common

# name -> (layers, hidden, rows, shortest, longest): "demo" is experiments/tiny_arith.py's learner
# (2 x 128, 16 problems x 4 kept rollouts a step, rollout.max_len 640); "wide" twice as deep and
# wide on the same rows (rows of 1,280 tokens at that width took 25 GiB in one update on the CPU).
SHAPES = {"demo": (2, 128, 64, 80, 640), "wide": (4, 256, 64, 80, 640)}


def _batch(rows: int, shortest: int, longest: int, vocab: int, seed: int):
    from rstar2_jax.learner import make_batch
    lengths = np.random.default_rng(0).integers(shortest, longest + 1, rows)  # every round: the same shapes
    lengths[0] = longest
    rng = np.random.default_rng(seed)
    tokens = [list(rng.integers(1, vocab, n)) for n in lengths]
    masks = [[0] * 60 + [1] * (n - 60) for n in lengths]  # a prompt of 60 tokens, then the model's
    return make_batch(tokens, masks, [[0.0] * n for n in lengths], list(rng.normal(size=rows)), pad_multiple=32)


def measure(shape: str, layout: str, rounds: int) -> dict:
    import jax
    import optax
    from flax import nnx

    from rstar2_jax.learner import Learner, LearnerSettings
    from rstar2_jax.models import Decoder
    from rstar2_jax.models.tiny import tiny_config

    layers, hidden, rows, shortest, longest = SHAPES[shape]
    cfg = tiny_config(num_layers=layers, hidden_size=hidden)
    budget = longest if layout == "packed" else 0
    learners = {source: Learner(Decoder(cfg, rngs=nnx.Rngs(0)), LearnerSettings(token_budget=budget,
                                                                                old_logprobs=source),
                                optimizer=optax.sgd(1.0))  # lr 1: the step is the gradient itself
                for source in ("separate", "auto")}
    times: dict[str, list[float]] = {source: [] for source in learners}
    steps = {}
    for r in range(rounds + 1):  # round 0 compiles
        order = list(learners) if r % 2 else list(reversed(learners))
        for source in order:
            learner, batch = learners[source], _batch(rows, shortest, longest, cfg.vocab_size, seed=r)
            before = jax.tree.leaves(learner.state.params)[0].copy() if r == 1 else None
            start = time.perf_counter()
            metrics = learner.update(batch)
            jax.block_until_ready(learner.state.params)
            if r:
                times[source].append(time.perf_counter() - start)
            if r == 1:
                steps[source] = np.asarray(jax.tree.leaves(learner.state.params)[0]) - np.asarray(before)
            assert metrics["old_logprob_pass"] == (source == "separate"), metrics
    separate, one = (float(np.median(times[s])) for s in ("separate", "auto"))
    ratios = [a / b for a, b in zip(times["auto"], times["separate"])]
    return dict(shape=shape, layout=layout, separate_s=separate, one_pass_s=one, ratio=float(np.median(ratios)),
                ratios=ratios, saved_s=separate - one,
                step_diff=float(np.abs(steps["auto"] - steps["separate"]).max()),
                step_max=float(np.abs(steps["separate"]).max()))


def demo_step_s(path: str) -> tuple[float, float]:
    """The median RL step and learner time of a demo run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if r.get("phase") == "rl" and "time/step_s" in r]
    return (float(np.median([r["time/step_s"] for r in rows])), float(np.median([r["time/learner_s"] for r in rows])))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="demo,wide")
    p.add_argument("--layouts", default="padded,packed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--demo_metrics", help="a CPU demo run's metrics.jsonl: the share of its step saved")
    p.add_argument("--record")
    args = p.parse_args(argv)
    results = []
    for shape in args.shapes.split(","):
        for layout in args.layouts.split(","):
            results.append(measure(shape, layout, args.rounds))
            print(results[-1], flush=True)
    header = ["shape", "rows", "separate pass: update s (median)", "one pass: update s (median)",
              "one / separate (median of rounds)", "rounds' ratios", "saved s", "step difference (largest; the step)"]
    table = []
    for r in results:
        layers, hidden, rows, shortest, longest = SHAPES[r["shape"]]
        rows_label = r["layout"] + (f", budget {longest}" if r["layout"] == "packed" else "")
        table.append((f"{r['shape']} ({layers} x {hidden}, {rows} rows of {shortest}-{longest})", rows_label,
                      f"{r['separate_s']:.2f}", f"{r['one_pass_s']:.2f}", f"{r['ratio']:.2f}x",
                      ", ".join(f"{x:.2f}" for x in r["ratios"]), f"{r['saved_s']:.2f}",
                      f"{r['step_diff']:.1e}; {r['step_max']:.1e}"))
    notes = ""
    if args.demo_metrics:
        step_s, learner_s = demo_step_s(args.demo_metrics)
        demo = [r for r in results if r["shape"] == "demo" and r["layout"] == "padded"]
        if demo:
            notes = (f"The demo's RL step ({args.demo_metrics}): median {step_s:.2f} s, its learner {learner_s:.2f} s; "
                     f"the padded demo shape's saving, {demo[0]['saved_s']:.2f} s, is "
                     f"{demo[0]['saved_s'] / step_s:.0%} of that step.")
            print(notes)
    config = (f"tiny Qwen3 shapes (module SHAPES), float32, SGD; token entropies on (rl.token_entropy, both paths); "
              f"{args.rounds} timed rounds after a compiling one, the two paths alternating within each round")
    common.record(args.record, "Learner: one pass where one is exact (issue 81)",
                  common.command_line("experiments.benchmarks.learner_passes", argv).strip(), config,
                  common.markdown_table(header, table), notes, group=common.LEARNER)


if __name__ == "__main__":
    main()
