"""Benchmark scoring under rStar2-Agent's protocol: k samples per problem, pass@1 averaged over
samples, with a 95% interval over problems."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import numpy as np

from rstar2_jax.rollout.scoring import RolloutOutcome, Scored, summarize

# Multiple-choice questions already list their options; this asks for the letter in the box.
CHOICE_INSTRUCTION = "\n\nPut only the letter of the correct option (A, B, C or D) in \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    path: str
    multiple_choice: bool = False   # graded on the option letter (rewards.choice_reward)


BENCHMARK_FILES = {"aime24": "aime24.jsonl", "aime25": "aime25.jsonl", "math500": "math_500.jsonl",
                   "amc23": "amc23.jsonl", "gpqa_diamond": "gpqa_diamond.jsonl"}
MULTIPLE_CHOICE = {"gpqa_diamond"}


def resolve_benchmark(name: str, data_dir: str | None) -> Benchmark:
    """A known benchmark name (its file under `data_dir`) or the path of any problem set (data/problems.py)
    (named after the file; multiple choice if its name says gpqa). Nothing is looked up outside
    what the caller names: the benchmark files are not shipped (README: Evaluation)."""
    if name.endswith((".jsonl", ".parquet")) or os.path.sep in name or os.path.exists(name):  # a path
        stem = os.path.splitext(os.path.basename(os.path.normpath(name)))[0]
        return Benchmark(stem, name, multiple_choice="gpqa" in stem.lower())
    if name not in BENCHMARK_FILES:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARK_FILES)} (or the path of a problem set: JSONL, "
                         "Parquet or a datasets folder)")
    if not data_dir:
        raise ValueError(f"benchmark {name!r} is read from {BENCHMARK_FILES[name]} in a data directory: pass "
                         f"--data_dir DIR (or set RSTAR2_DATA_DIR), or give the .jsonl path; README (Evaluation) "
                         f"says where the public sets come from")
    return Benchmark(name, os.path.join(data_dir, BENCHMARK_FILES[name]), name in MULTIPLE_CHOICE)


def benchmark_summary(scored: Sequence[Scored | RolloutOutcome], samples: int) -> dict[str, float]:
    """`scored` holds `samples` consecutive rollouts per problem: pass@1 (the accuracy averaged over
    each problem's samples, then over problems) with a 95% interval over problems, and the shared
    per-rollout METRICS (rollout/scoring.py)."""
    if not scored or len(scored) % samples:
        raise ValueError(f"{len(scored)} rollouts do not split into groups of {samples}")
    outcomes = [RolloutOutcome.of(s) for s in scored]
    per_problem = np.array([o.reward for o in outcomes], dtype=np.float64).reshape(-1, samples).mean(axis=1)
    n = len(per_problem)
    half = 1.96 * per_problem.std(ddof=1) / math.sqrt(n) if n > 1 else 0.0
    return {
        "problems": n, "samples": samples, "pass@1": float(per_problem.mean()),
        "ci95_low": float(max(0.0, per_problem.mean() - half)), "ci95_high": float(min(1.0, per_problem.mean() + half)),
        **summarize(outcomes),
    }


def markdown_table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| benchmark | pass@1 | 95% interval | format failures | response tokens / rollout | tool calls / rollout | "
             "tool-error ratio (correct rollouts) | tool-error ratio (all calls) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} ({r['problems']} x {r['samples']}) | {r['pass@1']:.1%} | "
                     f"{r['ci95_low']:.1%} - {r['ci95_high']:.1%} | {r.get('format_failure_rate', float('nan')):.1%} | "
                     f"{r['mean_response_tokens']:.0f} | "
                     f"{r['mean_tool_calls']:.2f} | {r['tool_error_ratio_correct']:.3f} | "
                     f"{r['tool_error_ratio_all']:.3f} |")
    return "\n".join(lines)
