"""The paper's offline difficulty filter before a stage: every training problem sampled k times,
problems solved k/k dropped; resumable from its results file; and a real run that applies it."""

import asyncio
import json

import pytest

from rstar2_jax.data.arith import Problem
from rstar2_jax.data.jsonl import DataError
from rstar2_jax.rl.prefilter import prefilter_solved, read_results
from rstar2_jax.rl.trainer import run
from rstar2_jax.traces import read_traces
from tests.rl.test_training import small_config

PROBLEMS = [Problem(str(i), f"q{i}", "1", "1") for i in range(7)]


def _solver(solved_of, calls):
    async def solve(problems, k):
        calls.append([p.id for p in problems])
        return [solved_of(p.id, k) for p in problems]
    return solve


def test_problems_solved_k_of_k_are_dropped_and_results_are_saved(tmp_path):
    path = str(tmp_path / "prefilter" / "stage2.jsonl")
    calls = []
    solved = asyncio.run(prefilter_solved(PROBLEMS, 8, path, _solver(lambda i, k: k if int(i) % 3 == 0 else 5, calls),
                                          chunk=3))
    assert solved == {"0", "3", "6"}
    assert [len(c) for c in calls] == [3, 3, 1]  # in chunks, each problem once
    assert read_results(path) == {str(i): (8 if i % 3 == 0 else 5) for i in range(7)}
    summary = json.loads((tmp_path / "prefilter" / "stage2.summary.json").read_text())
    assert summary == {"problems": 7, "solved_k_of_k": 3, "kept": 4, "k": 8}


def test_a_restarted_pre_filter_samples_only_what_is_missing_and_survives_a_cut_line(tmp_path):
    path = tmp_path / "stage1.jsonl"
    path.write_text('{"id": "0", "solved": 4, "k": 4}\n{"id": "1", "solved": 1, "k": 4}\n{"id": "2", "sol')
    calls = []
    solved = asyncio.run(prefilter_solved(PROBLEMS, 4, str(path), _solver(lambda i, k: k, calls), chunk=10))
    assert calls == [["2", "3", "4", "5", "6"]]  # 0 and 1 were done; 2's line was cut short by the crash
    assert solved == {"0", "2", "3", "4", "5", "6"}
    assert read_results(str(path))["1"] == 1 and len(read_results(str(path))) == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "solved": 4}\n{oops\n{"id": "1", "solved": 4}\n')
    with pytest.raises(DataError, match=f"{bad}:2"):
        read_results(str(bad))


def _two_stage_config(steps=3):
    cfg = small_config(steps=steps)
    cfg.eval.before_and_after = False
    cfg.data.train_problems = 6
    cfg.rl.batch_problems = 2
    cfg.stages = [dict(start_step=0, max_response_tokens=120, max_turns=2, filter_solved_k=0, filter_mode="offline",
                       reset_optimizer=False),
                  dict(start_step=1, max_response_tokens=120, max_turns=2, filter_solved_k=2, filter_mode="offline",
                       reset_optimizer=True)]
    return cfg


def _verl_parquet(path, problems):
    """The problems as verl RL Parquet rows (prompt as chat, reward_model.ground_truth, extra_info.index)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "arith", "prompt": [{"role": "user", "content": p.question}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": {"index": f"row-{p.id}"}}
        for p in problems]), path)
    return str(path)


@pytest.mark.slow
def test_a_run_pre_filters_when_the_stage_begins_and_never_trains_on_dropped_problems(tmp_path):
    """Trained from a verl Parquet set (issue 39): the pre-filter, traces and ids are the file's."""
    from rstar2_jax.data import arith
    from rstar2_jax.data.tasks import make_task

    cfg = _two_stage_config()
    cfg.sft.steps = 0  # the problems task has no SFT data: the tiny model starts untrained
    cfg.data.task = "problems"
    cfg.data.problems.train_path = _verl_parquet(tmp_path / "train.parquet", arith.make_problems(6, seed=1))
    cfg.data.problems.eval_path = _verl_parquet(tmp_path / "eval.parquet", arith.make_problems(4, seed=2))
    ids = [p.id for p in make_task(cfg.data, cfg.seed).train_problems]
    assert ids == [f"row-1-{i}" for i in range(6)]  # extra_info.index
    # Results already on disk for 4 of the 6 problems (as after a crash mid-pre-pass): two of them
    # "solved 2/2". The run samples the other two for real and drops whatever is solved 2/2.
    pre = tmp_path / "prefilter"
    pre.mkdir(parents=True)
    (pre / "stage1.jsonl").write_text("".join(json.dumps({"id": i, "solved": n, "k": 2}) + "\n"
                                             for i, n in zip(ids[:4], (2, 0, 2, 1))))
    run(cfg, str(tmp_path))
    results = read_results(str(pre / "stage1.jsonl"))
    assert set(results) == set(ids) and all(0 <= n <= 2 for n in results.values())
    dropped = {i for i, n in results.items() if n == 2}
    assert {ids[0], ids[2]} <= dropped
    traces = read_traces(tmp_path / "traces")
    assert set(traces[traces["step"] >= 1]["problem_id"]).isdisjoint(dropped)
    assert set(traces[traces["step"] == 0]["problem_id"])  # stage 0 trained before the filter
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["dropped"] for l in lines if l["phase"] == "prefilter"] == [len(dropped)]  # run once
