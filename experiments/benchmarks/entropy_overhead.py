"""What the per-token entropy costs in the learner's old-log-prob pass (the RL loop's update runs
`Learner.logprobs(tokens, with_entropy=True)` since the token-entropy analysis was added).

    python -m experiments.benchmarks.entropy_overhead --model qwen3_0p6b --layers 4 --rows 2 --seq 512 \
        [--record BENCHMARKS.md]

Both passes are timed in one run, alternating (median of --repeats each), so the ratio is what to
read on a shared machine. --layers cuts the shape's depth (the overhead is in the vocab-sized LM
head, so fewer layers make the ratio a pessimistic bound; use the full depth on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from rstar2_jax.learner import Learner, LearnerSettings
from rstar2_jax.models import Decoder


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_0p6b")
    p.add_argument("--layers", type=int, default=0, help="override the depth (0: the shape's own)")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--record", help="append the result block to this markdown file")
    args = p.parse_args(argv)
    cfg = common.shape(args.model)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    model = Decoder(cfg, dtype=getattr(jnp, args.dtype), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    learner = Learner(model, LearnerSettings())
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.rows, args.seq), dtype=np.int32)
    passes = {"log-probs": lambda: learner.logprobs(tokens),
              "log-probs + entropy": lambda: learner.logprobs(tokens, with_entropy=True)}
    for fn in passes.values():  # compile both, then warm
        fn(), fn()
    times = {name: [] for name in passes}
    for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()  # returns host numpy arrays: blocks until done
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["log-probs"])
    rows = [[name, f"{statistics.median(t) * 1e3:.1f}", f"{args.rows * args.seq / statistics.median(t):.0f}",
             f"{statistics.median(t) / base:.3f}"] for name, t in times.items()]
    table = common.markdown_table(["pass", "median ms", "tokens/s", "time vs log-probs only"], rows)
    common.record(args.record, f"Entropy in the old-log-prob pass: {args.model}",
                  "python -m experiments.benchmarks.entropy_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
                  f"{args.model} shape, {cfg.num_layers} layers, vocab {cfg.vocab_size}, {args.dtype} compute, "
                  f"{args.rows} x {args.seq} tokens, median of {args.repeats} alternating repeats", table, group=common.LEARNER)


if __name__ == "__main__":
    main()
