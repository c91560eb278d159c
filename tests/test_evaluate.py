"""Benchmark scoring math, and the evaluate CLI end to end on the tiny model with the shared data."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rstar2_jax.eval_report import benchmark_summary, markdown_table
from rstar2_jax.models import tiny
from rstar2_jax.rl.evaluation import Scored
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")


def _scored(reward, statuses=(), n_tokens=10):
    t = Trajectory(prompt_len=2, token_ids=[0] * (2 + n_tokens), loss_mask=[0] * (2 + n_tokens),
                   logprobs=[0.0] * (2 + n_tokens))
    t.turns = [Turn("x", n_tokens, "eos", 0, 0, [ToolRecord("c", "", s, "", 0.0) for s in statuses])]
    return Scored(t, reward)


def test_pass_at_1_is_averaged_over_samples_with_an_interval():
    # 3 problems x 4 samples: 4/4, 2/4, 0/4 correct
    rewards = [1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    scored = [_scored(r, ("ok", "error") if i == 0 else ("ok",)) for i, r in enumerate(rewards)]
    s = benchmark_summary(scored, samples=4)
    per_problem = np.array([1.0, 0.5, 0.0])
    half = 1.96 * per_problem.std(ddof=1) / np.sqrt(3)
    assert s["pass@1"] == pytest.approx(0.5) and s["ci95_low"] == pytest.approx(max(0, 0.5 - half))
    assert s["tool_calls_per_problem"] == pytest.approx(13 / 3) and s["tool_error_ratio"] == pytest.approx(1 / 13)
    assert "| 50.0% |" in markdown_table({"x": s})
    with pytest.raises(ValueError, match="groups of 5"):
        benchmark_summary(scored, samples=5)


def test_evaluate_cli_writes_tables_and_traces(tmp_path):
    model = tiny.build_tiny_model(tmp_path / "m")
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", "--benchmarks=aime24,gpqa_diamond",
                           f"--data_dir={DATA}", "--limit=2", "--samples=2", "--max_tokens=40", "--max_turns=2",
                           "--format=tiny", f"--out={out}", "--slots=4"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"]["samples"] == 2
    for name in ("aime24", "gpqa_diamond"):
        r = results["results"][name]
        assert r["problems"] == 2 and 0 <= r["pass@1"] <= 1
        assert os.listdir(out / "traces" / name)
    assert "| aime24 (2 x 2) |" in (out / "results.md").read_text()


def test_evaluate_cli_rejects_unknown_benchmarks(tmp_path):
    model = tiny.build_tiny_model(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", "--benchmarks=imo99",
                           f"--data_dir={DATA}", f"--out={tmp_path / 'e'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "unknown benchmark 'imo99'" in proc.stderr
