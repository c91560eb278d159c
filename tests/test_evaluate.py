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
from rstar2_jax.reports.eval_report import benchmark_summary, markdown_table, resolve_benchmark
from rstar2_jax.models import tiny
from rstar2_jax.rollout.scoring import Scored
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
                 "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put "
                 "your answer on its own line after \"Answer:\".")


def _scored(reward, statuses=(), n_tokens=10, answer="1"):
    t = Trajectory(prompt_len=2, token_ids=[0] * (2 + n_tokens), loss_mask=[0] * (2 + n_tokens),
                   logprobs=[0.0] * (2 + n_tokens))
    t.turns = [Turn("x", n_tokens, "eos", 0, 0, [ToolRecord("c", "", s, "", 0.0) for s in statuses])]
    return Scored(t, reward, answer)


def test_format_failures_are_counted_apart_from_wrong_answers():
    # 4 rollouts of one problem: right, wrong, and two with no answer in the graded format
    s = benchmark_summary([_scored(1), _scored(0), _scored(0, answer=None), _scored(0, answer=None)], samples=4)
    assert s["accuracy"] == pytest.approx(0.25) and s["format_failure_rate"] == pytest.approx(0.5)
    assert "| format failures |" in markdown_table({"b": s}) and "| 50.0% |" in markdown_table({"b": s})


def test_answer_formats_per_benchmark_and_every_bad_entry_at_once():
    from absl import app

    from rstar2_jax.evaluate import benchmark_answer_formats
    names = ["aime24", "gpqa_diamond"]
    assert benchmark_answer_formats([], names, "dapo") == {"aime24": "dapo", "gpqa_diamond": "dapo"}
    assert benchmark_answer_formats(["boxed", "gpqa_diamond=choice_letter"], names, "answer_boxed") == {
        "aime24": "boxed", "gpqa_diamond": "choice_letter"}
    with pytest.raises(app.UsageError) as e:
        benchmark_answer_formats(["math500=boxed", "aime24=Answer"], names, "answer_boxed")
    assert "'math500' is not among --benchmarks" in str(e.value) and "unknown answer format 'Answer'" in str(e.value)


def test_pass_at_1_is_averaged_over_samples_with_an_interval():
    # 3 problems x 4 samples: 4/4, 2/4, 0/4 correct
    rewards = [1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    scored = [_scored(r, ("ok", "error") if i == 0 else ("ok",)) for i, r in enumerate(rewards)]
    s = benchmark_summary(scored, samples=4)
    per_problem = np.array([1.0, 0.5, 0.0])
    half = 1.96 * per_problem.std(ddof=1) / np.sqrt(3)
    assert s["pass@1"] == pytest.approx(0.5) and s["ci95_low"] == pytest.approx(max(0, 0.5 - half))
    # per rollout: 13 calls over 12 rollouts; 1 failed of 13 calls; correct rollouts with calls:
    # the first (1 of 2 failed) and five with none failed
    assert s["mean_tool_calls"] == pytest.approx(13 / 12) and s["tool_error_ratio_all"] == pytest.approx(1 / 13)
    assert s["tool_error_ratio_correct"] == pytest.approx(0.5 / 6) and s["accuracy"] == pytest.approx(0.5)
    assert "| 50.0% |" in markdown_table({"x": s})
    with pytest.raises(ValueError, match="groups of 5"):
        benchmark_summary(scored, samples=5)


@pytest.mark.slow
@pytest.mark.parametrize("kv", [[], ["--page_size=16", "--kv_pages=40"]], ids=["slot_rows", "paged"])
def test_evaluate_cli_writes_tables_and_traces(tmp_path, benchmark_dir, kv):
    """The paged variant scores a verl Parquet set as its second benchmark (issue 39), by path."""
    model = tiny.build_tiny_model(tmp_path / "m")
    out = tmp_path / "eval"
    second = "gpqa_diamond"
    if kv:
        import pyarrow as pa
        import pyarrow.parquet as pq
        second = str(tmp_path / "dapo.parquet")
        pq.write_table(pa.Table.from_pylist([
            {"data_source": "math_dapo", "prompt": [{"content": DAPO_TEMPLATE.format(f"What is {i}+{i}?"), "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": f"p{i}"}} for i in range(3)]), second)
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", f"--benchmarks=aime24,{second}",
                           f"--data_dir={benchmark_dir}", "--limit=2", "--samples=2", "--max_tokens=40", "--max_turns=2",
                           "--format=tiny", f"--out={out}", "--slots=4", *kv, *(["--instructions=keep"] if kv else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if kv:  # DAPO's own instruction kept, graded as answer_boxed: evaluate warns as train does (issue 69)
        [warning] = [line for line in proc.stderr.splitlines() if line.startswith("warning: --instructions=keep")]
        assert "dapo_math_17k" in warning and "--answer_format=dapo" in warning and "--instructions=strip" in warning
    results = json.loads((out / "results.json").read_text())
    assert results["protocol"]["samples"] == 2
    for name in ("aime24", "dapo" if kv else "gpqa_diamond"):
        r = results["results"][name]
        assert r["problems"] == 2 and 0 <= r["pass@1"] <= 1
        assert os.listdir(out / "traces" / name)
    assert "| aime24 (2 x 2) |" in (out / "results.md").read_text()


def test_evaluate_warns_of_a_kept_template_against_the_grading_and_the_prompt_format(tmp_path):
    from rstar2_jax.reports.eval_report import resolve_benchmark
    from rstar2_jax.evaluate import instruction_warnings
    rows = [{"problem": DAPO_TEMPLATE.format("What is 1+1?"), "answer": "2"}]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = resolve_benchmark(str(path), None)
    stored = [(bench, load_problems(path))]
    graded_dapo = {bench.name: "dapo"}
    [conflict] = instruction_warnings(stored, "keep", graded_dapo, "rstar2", "answer_boxed")
    assert "two conflicting answer instructions" in conflict and "--format=tiny" in conflict
    assert instruction_warnings(stored, "keep", graded_dapo, "tiny", "") == []
    assert instruction_warnings(stored, "strip", {bench.name: "answer_boxed"}, "rstar2", "answer_boxed") == []
    assert len(instruction_warnings(stored, "keep", {bench.name: "answer_boxed"}, "rstar2", "answer_boxed")) == 2


def test_every_metric_has_one_definition_in_the_readme():
    """train, evaluate, traces and the notebooks use the names of rollout.scoring.METRICS; the README
    defines each once, in its metric table."""
    from rstar2_jax.rollout.scoring import METRICS
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("| metric | definition |"):]
    table = table[:table.index("\n\n")]
    for name in METRICS:
        assert f"| `{name}` |" in table, name
    assert set(benchmark_summary([_scored(1, ("ok",))], samples=1)) >= set(METRICS)


def test_run_defaults_come_from_the_checkpoint_s_last_stage(tmp_path):
    from rstar2_jax.evaluate import PAPER_MAX_TOKENS, run_defaults
    (tmp_path / "config.json").write_text(json.dumps({"stages": [{"max_response_tokens": 100, "max_turns": 3},
                                                                 {"max_response_tokens": 200, "max_turns": 4}]}))
    assert run_defaults(str(tmp_path), None, None) == (200, 4)
    assert run_defaults(str(tmp_path), 50, None) == (50, 4)
    assert run_defaults(None, None, 7) == (PAPER_MAX_TOKENS, 7)


def _many_problems(path, n):
    path.write_text("".join(json.dumps({"problem": f"{i} + {i}", "answer": str(2 * i)}) + "\n" for i in range(n)))
    return path


@pytest.mark.slow
def test_an_interrupted_evaluation_keeps_its_problems_and_resumes(tmp_path):
    """Ctrl-C once a problem is kept: exit 130, no traceback; the same command then runs only the
    problems not kept, and the summary covers all of them. Another protocol in the same --out is
    refused. A budget past the model's positions is capped with a warning."""
    import signal
    import time

    # 512 positions: the random model samples to the budget, so its size is the test's decode time
    model = tiny.build_tiny_model(tmp_path / "m", max_position_embeddings=512)
    bench = _many_problems(tmp_path / "sums.jsonl", 12)
    out = tmp_path / "eval"
    args = [sys.executable, "-m", "rstar2_jax.evaluate", f"--model={model}", f"--benchmarks={bench}", "--samples=2",
            "--max_tokens=9000", "--max_turns=2", "--format=tiny", f"--out={out}", "--slots=2"]
    kept = out / "sums" / "problems.jsonl"
    # SIGINT as a terminal's Ctrl-C delivers it: a pytest-xdist worker ignores SIGINT and a child
    # inherits that, so the evaluation starts through a shim that restores it, then execs
    shim = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                                  "os.execv(sys.executable, sys.argv[1:])"]
    proc = subprocess.Popen(shim + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not (kept.exists() and kept.read_text().strip()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: every finished problem is kept" in err and "Traceback" not in err, err[-2000:]
    assert "capped at" in err and "512 positions" in err
    first = [json.loads(line) for line in kept.read_text().splitlines()]
    assert 1 <= len(first) < 12
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{len(first)} of 12 problems kept from an earlier run" in done.stdout
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(12))
    assert rows[:len(first)] == first  # the kept problems were not run again
    results = json.loads((out / "results.json").read_text())
    assert results["results"]["sums"]["problems"] == 12
    assert results["protocol"]["token_budgets"]["sums"] < 512
    assert len(os.listdir(out / "traces" / "sums")) == 12
    other = subprocess.run(args[:-1] + ["--samples=3", "--slots=2"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert other.returncode == 2 and "holds the results of another evaluation (it differs in samples)" in other.stderr


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
    good = _many_problems(tmp_path / "good.jsonl", 2)
    # the broken file comes second: it is still found before the first benchmark runs
    proc = _evaluate(tmp_path, f"--model={model}", f"--benchmarks={good},{path}", "--format=tiny",
                     f"--out={tmp_path / 'e'}")
    assert proc.returncode != 0 and f"{path}:2: invalid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "e" / "good").exists()  # no rollout ran


def test_evaluate_cli_needs_urls_for_vllm(tmp_path, benchmark_dir):
    model = tiny.build_tiny_model(tmp_path / "m")
    proc = _evaluate(tmp_path, f"--model={model}", "--engine=vllm", f"--data_dir={benchmark_dir}", f"--out={tmp_path / 'e'}")
    assert proc.returncode != 0 and "--url: rollout.engine=vllm needs the server URLs" in proc.stderr
    proc = _evaluate(tmp_path, f"--model={model}", "--engine=vllm", "--url=http://127.0.0.1:9", "--scheduler=fastest",
                     f"--data_dir={benchmark_dir}", f"--out={tmp_path / 'e'}")
    assert proc.returncode != 0
    assert "--scheduler: unknown scheduler policy 'fastest'; registered: kv_aware, least_requests, round_robin" in proc.stderr


def test_column_flags_per_benchmark_and_every_bad_entry_at_once():
    """Issue 80: evaluate takes train's column mapping, as --question_key / --answer_key / --id_key."""
    from absl import app

    from rstar2_jax.data.problems import Columns
    from rstar2_jax.evaluate import benchmark_columns
    names = ["aime24", "mine"]
    assert benchmark_columns({"question": [], "answer": [], "id": []}, names) == {"aime24": Columns(), "mine": Columns()}
    assert benchmark_columns({"question": ["mine=input"], "answer": ["mine=target.value"], "id": ["uid"]}, names) == {
        "aime24": Columns(id="uid"), "mine": Columns("input", "target.value", "uid")}
    with pytest.raises(app.UsageError) as e:
        benchmark_columns({"question": ["theirs=q", "mine=input"], "answer": ["aime24="], "id": []}, names)
    assert "--question_key=theirs=q: 'theirs' is not among --benchmarks" in str(e.value)
    assert "--answer_key=aime24=: give a field's dotted path" in str(e.value)
    assert "--question_key for mine needs --answer_key too" in str(e.value)


def test_a_set_in_another_layout_names_evaluate_s_flags_and_is_read_with_them(tmp_path):
    """The error said to set --config.data.problems.question_key, a flag evaluate did not have; and
    --limit stopped reading at its limit though every row is to be checked first."""
    from rstar2_jax.evaluate import evaluate_names
    path = tmp_path / "odd.jsonl"
    rows = [json.dumps({"input": f"{i} + {i}", "target": {"value": str(2 * i)}}) for i in range(2)]
    path.write_text("\n".join(rows) + "\n" + '{"input": "3 + 3", "target"' + "\n")
    with pytest.raises(DataError) as e:
        load_problems(path)
    told = evaluate_names(str(e.value))
    assert "--question_key=" in told and "--answer_key=" in told and "data.problems" not in told, told
    model = tiny.build_tiny_model(tmp_path / "m")
    proc = _evaluate(tmp_path, f"--model={model}", f"--benchmarks={path}", "--question_key=input",
                     "--answer_key=target.value", "--limit=1", "--format=tiny", f"--out={tmp_path / 'e'}")
    # rows 1-2 read through the mapping (without it row 1 fails), row 3 checked despite --limit=1
    assert proc.returncode == 2 and f"{path}:3: invalid JSON" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
