"""A training run's directory read back: config, metrics, results and traces, plus the per-step
numbers the explore notebook plots, split by positive/negative and kept/dropped by RoC."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pandas as pd

from rstar2_jax.data.jsonl import iter_jsonl
from rstar2_jax.rewards.penalties import FAILED_TOOL_STATUSES
from rstar2_jax.traces.schema import read_traces


def _by_step(rows: list[dict]) -> pd.DataFrame:
    """A resumed run logs the steps after its last checkpoint again: the last record wins."""
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)


@dataclasses.dataclass
class Run:
    dir: str
    config: dict          # config.json (empty for runs that predate it)
    metrics: pd.DataFrame  # one row per RL step (metrics.jsonl, phase "rl")
    evals: pd.DataFrame    # before/after evaluations (phase "eval")
    results: dict          # results.json (empty until the run finished)
    model_dir: str         # the base model: its tokenizer decodes token ids

    def traces(self, columns: list[str] | None = None) -> pd.DataFrame:
        return read_traces(os.path.join(self.dir, "traces"), columns=columns)

    def tokenizer(self):
        from rstar2_jax.models.tokenizer import Tokenizer
        return Tokenizer.from_pretrained(self.model_dir)


def load_run(run_dir: str | os.PathLike) -> Run:
    run_dir = os.path.abspath(os.fspath(run_dir))
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise FileNotFoundError(f"{run_dir} is not a training run directory (no metrics.jsonl)")

    def read_json(name, default):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            return default
        with open(path) as f:
            return json.load(f)

    rows = [row for _, _, row in iter_jsonl(metrics_path, "metrics file")]
    evals = pd.DataFrame([r for r in rows if r.get("phase") == "eval"])
    model_dir = read_json("run.json", {}).get("model_dir", os.path.join(run_dir, "base_model"))
    return Run(run_dir, read_json("config.json", {}), _by_step([r for r in rows if r.get("phase") == "rl"]),
               evals, read_json("results.json", {}), model_dir)


def with_trajectory_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Adds positive (reward > 0), outcome ("positive"/"negative"), roc ("kept"/"dropped"),
    num_tool_errors, tool_calls_per_turn and has_tool_error."""
    df = df.copy()
    statuses = df["turns"].map(lambda turns: [tool["status"] for t in turns for tool in t["tools"]])
    df["num_tool_errors"] = statuses.map(lambda s: sum(x in FAILED_TOOL_STATUSES for x in s)).astype(int)
    df["has_tool_error"] = df["num_tool_errors"] > 0
    df["tool_calls_per_turn"] = df["num_tool_calls"] / df["num_turns"].clip(lower=1)
    df["positive"] = df["reward"] > 0
    df["outcome"] = np.where(df["positive"], "positive", "negative")
    df["roc"] = np.where(df["kept"], "kept", "dropped")
    return df


def step_stats(df: pd.DataFrame, by: tuple[str, ...] = ("outcome", "roc")) -> pd.DataFrame:
    """Per step (and per value of each `by` column): rollouts and the METRICS of rollout/scoring.py
    that a trace row holds (accuracy, format_failure_rate: no answer in the graded format,
    mean_response_tokens, mean_tool_calls, tool_error_ratio_all: failed / all calls, pooled), plus
    tool calls per turn.
    `df` must have the columns of `with_trajectory_columns`."""
    g = df.assign(format_failure=df["extracted_answer"].isna()).groupby(["step", *by], sort=True)
    out = g.agg(rollouts=("reward", "size"), accuracy=("reward", "mean"), format_failure_rate=("format_failure", "mean"),
                mean_response_tokens=("num_response_tokens", "mean"), mean_tool_calls=("num_tool_calls", "mean"),
                tool_calls_per_turn=("tool_calls_per_turn", "mean"), calls=("num_tool_calls", "sum"),
                errors=("num_tool_errors", "sum"))
    out["tool_error_ratio_all"] = (out["errors"] / out["calls"].where(out["calls"] > 0)).fillna(0.0)
    return out.drop(columns=["calls", "errors"]).reset_index()


def filter_traces(df: pd.DataFrame, *, step: int | None = None, positive: bool | None = None,
                  kept: bool | None = None, has_tool_error: bool | None = None,
                  problem: str | None = None) -> pd.DataFrame:
    """Rows matching every given filter; `problem` matches a problem id exactly or a substring of
    the problem text. `df` must have the columns of `with_trajectory_columns`."""
    keep = pd.Series(True, index=df.index)
    if step is not None:
        keep &= df["step"] == step
    if positive is not None:
        keep &= df["positive"] == positive
    if kept is not None:
        keep &= df["kept"] == kept
    if has_tool_error is not None:
        keep &= df["has_tool_error"] == has_tool_error
    if problem is not None:
        keep &= (df["problem_id"] == problem) | df["problem"].str.contains(problem, regex=False)
    return df[keep]
