"""What saving an in-flight rollout costs the event loop, per turn (rollout/journal.py).

    python -m experiments.benchmarks.journal_save [--turns 10] [--tokens 1600]

A trajectory grows by `tokens` model tokens (and a tool call) per turn; after each turn it is
saved as the journal does (the turn's difference appended as one JSON line) and, for comparison,
as the whole trajectory rewritten as one JSON document (what a naive journal does). Medians over
5 repeats of each turn's save, milliseconds; the saves run on the rollout loop's thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time

from rstar2_jax.rollout.journal import RolloutJournal
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn


def grow(turns: int, tokens: int):
    """Yields the same trajectory after each of its turns."""
    rng = random.Random(0)
    traj = Trajectory(prompt_len=200, token_ids=[], loss_mask=[], logprobs=[])
    traj.append([1] * 200, 0)
    for _ in range(turns):
        traj.append([rng.randrange(150_000) for _ in range(tokens)], 1, [-3 * rng.random() for _ in range(tokens)],
                    [3] * tokens)
        traj.turns.append(Turn("x" * 4 * tokens, tokens, "stop", 3, 3, [ToolRecord("print(1)", "", "ok", "1\n", 0.1)]))
        yield traj


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--tokens", type=int, default=1600)
    args = p.parse_args(argv)
    appended, rewritten = [[] for _ in range(args.turns)], [[] for _ in range(args.turns)]
    with tempfile.TemporaryDirectory() as d:
        for repeat in range(5):
            journal = RolloutJournal(os.path.join(d, f"r{repeat}.jsonl"), "id", None)
            for i, traj in enumerate(grow(args.turns, args.tokens)):
                start = time.perf_counter()
                journal.save(traj, finished=False)
                appended[i].append(time.perf_counter() - start)
                start = time.perf_counter()
                with open(os.path.join(d, "whole.json"), "w") as f:
                    json.dump(dataclasses.asdict(traj), f)
                rewritten[i].append(time.perf_counter() - start)
    print("| turn | trajectory tokens | append the turn (ms) | rewrite the whole (ms) |\n|---|---|---|---|")
    for i in range(args.turns):
        print(f"| {i + 1} | {200 + (i + 1) * args.tokens} | {1e3 * statistics.median(appended[i]):.2f} | "
              f"{1e3 * statistics.median(rewritten[i]):.1f} |")


if __name__ == "__main__":
    main()
