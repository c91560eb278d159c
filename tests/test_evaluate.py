"""Benchmark scoring math, benchmark files (names, paths, HF variants, malformed lines), and the
evaluate CLI end to end on the tiny model with small files in the public sets' formats."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rstar2_jax.data.jsonl import DataError
from rstar2_jax.data.problems import load_problems
from rstar2_jax.eval_report import benchmark_summary, markdown_table, resolve_benchmark
from rstar2_jax.models import tiny
from rstar2_jax.rollout.scoring import Scored
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.slow
@pytest.mark.parametrize("kv", [[], ["--page_size=16", "--kv_pages=20"]], ids=["slot_rows", "paged"])
def test_evaluate_cli_writes_tables_and_traces(tmp_path, benchmark_dir, kv):
    model = tiny.build_tiny_model(tmp_path / "m")
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", "--benchmarks=aime24,gpqa_diamond",
                           f"--data_dir={benchmark_dir}", "--limit=2", "--samples=2", "--max_tokens=40", "--max_turns=2",
                           "--format=tiny", f"--out={out}", "--slots=4", *kv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"]["samples"] == 2
    for name in ("aime24", "gpqa_diamond"):
        r = results["results"][name]
        assert r["problems"] == 2 and 0 <= r["pass@1"] <= 1
        assert os.listdir(out / "traces" / name)
    assert "| aime24 (2 x 2) |" in (out / "results.md").read_text()


def test_evaluate_cli_rejects_unknown_benchmarks(tmp_path, benchmark_dir):
    model = tiny.build_tiny_model(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", "--benchmarks=imo99",
                           f"--data_dir={benchmark_dir}", f"--out={tmp_path / 'e'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "unknown benchmark 'imo99'" in proc.stderr


def _evaluate(tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_benchmark_names_resolve_in_the_data_dir_with_their_golds(benchmark_dir):
    sizes = {"aime24": 3, "aime25": 2, "math500": 3, "amc23": 2, "gpqa_diamond": 2}
    for name, n in sizes.items():
        bench = resolve_benchmark(name, benchmark_dir)
        problems = load_problems(bench.path)
        assert len(problems) == n and all(p.question and p.answer for p in problems)
        assert bench.multiple_choice == (name == "gpqa_diamond")
    assert {p.answer for p in load_problems(resolve_benchmark("gpqa_diamond", benchmark_dir).path)} == {"B", "C"}
    custom = resolve_benchmark("/data/my_gpqa_subset.jsonl", None)
    assert custom.name == "my_gpqa_subset" and custom.multiple_choice
    with pytest.raises(ValueError, match="unknown benchmark 'imo99'"):
        resolve_benchmark("imo99", benchmark_dir)
    with pytest.raises(ValueError, match="pass --data_dir DIR"):  # names never resolve anywhere by default
        resolve_benchmark("aime24", None)


def test_hf_style_question_solution_rows_take_the_boxed_answer(tmp_path):
    path = tmp_path / "hf.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "solution": "So it is \\boxed{\\frac{4}{2}}."}) + "\n"
                    + json.dumps({"problem": "2+2?", "answer": 4.0}) + "\n")
    problems = load_problems(path)
    assert [(p.question, p.answer) for p in problems] == [("1+1?", "\\frac{4}{2}"), ("2+2?", "4")]


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    (json.dumps({"question": "x", "solution": "no box here"}), "no answer field"),
    (json.dumps({"answer": "3"}), "no problem text"),
])
def test_malformed_benchmark_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "ok", "answer": "1"}) + "\n\n" + line + "\n")
    with pytest.raises(DataError, match=f"{path}:3: {message}"):
        load_problems(path)


def test_evaluate_cli_reports_a_malformed_file_by_file_and_line(tmp_path):
    model = tiny.build_tiny_model(tmp_path / "m")
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n" + '{"problem": "2+2", "answer"' + "\n")
    proc = _evaluate(tmp_path, f"--model={model}", f"--benchmarks={path}", "--format=tiny", f"--out={tmp_path / 'e'}")
    assert proc.returncode != 0 and f"{path}:2: invalid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_evaluate_cli_needs_urls_for_vllm(tmp_path, benchmark_dir):
    model = tiny.build_tiny_model(tmp_path / "m")
    proc = _evaluate(tmp_path, f"--model={model}", "--engine=vllm", f"--data_dir={benchmark_dir}", f"--out={tmp_path / 'e'}")
    assert proc.returncode != 0 and "--url: rollout.engine=vllm needs the server URLs" in proc.stderr
    proc = _evaluate(tmp_path, f"--model={model}", "--engine=vllm", "--url=http://127.0.0.1:9", "--scheduler=fastest",
                     f"--data_dir={benchmark_dir}", f"--out={tmp_path / 'e'}")
    assert proc.returncode != 0 and "--scheduler: unknown scheduler policy 'fastest'; registered: kv_aware, least_requests, round_robin" in proc.stderr
