"""The paper's recipe as one system on this machine: experiments/rstar2_agent_14b.py's structure
(three stages, the offline pre-filter before the last with an optimizer reset) shrunk to the tiny
CPU model, run by two trainer processes with asynchronous rollouts (max_staleness=1), then
extended by a step and resumed from its checkpoint."""

import json
import os
import sys

import pytest

from rstar2_jax.rl.prefilter import read_results
from rstar2_jax.traces import read_traces
from tests.rl.launch import launch
from tests.rl.test_training import rl_lines

# Shrunk sizes, the recipe's structure. The barely trained policy solves nothing, so an advantage
# of alternating signs (registered in every process as the file loads) makes every step update,
# which is what lets rollouts lag the learner.
CONFIG = """
import numpy as np
from experiments import rstar2_agent_14b
from rstar2_jax.algo import ADVANTAGES

ADVANTAGES["test_alternating_signs"] = lambda rewards, eps=1e-6: np.where(
    np.arange(len(rewards)) % 2 == 0, 1.0, -1.0).astype(np.float32)


def get_config():
    c = rstar2_agent_14b.get_config()
    c.model.path, c.model.dtype, c.model.remat = "", "float32", "none"      # the tiny model on CPU
    c.model.attention = c.model.decode_attention = "xla"
    c.data.task, c.data.train_problems, c.data.eval_problems = "arith", 12, 4
    c.format = "tiny"
    c.sft.steps, c.sft.batch_size, c.sft.examples = 4, 4, 16
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.rollout.slots, c.rollout.max_len = 8, 256
    c.rollout.page_size, c.rollout.kv_memory_gb = 0, 0.0                 # the recipe's 160 GiB pool, shrunk away
    c.mesh.devices_per_process = 0                                       # two 1-device processes, not 8-GPU hosts
    c.rl.steps, c.rl.batch_problems, c.rl.group_size, c.rl.oversample = 4, 2, 2, 2
    c.rl.micro_batches, c.rl.lr, c.rl.warmup_steps = 1, 1e-4, 1
    c.rl.max_staleness, c.rl.correction.names = 1, ("token_tis",)
    c.rl.advantage, c.rl.roc.reject_uniform_groups = "test_alternating_signs", False
    c.stages = [dict(s, max_response_tokens=120, max_turns=2) for s in c.stages]
    c.stages[1]["start_step"], c.stages[2]["start_step"], c.stages[2]["filter_solved_k"] = 2, 3, 2
    c.sandbox.workers = 1
    c.eval.before_and_after = False
    c.checkpoint.every, c.checkpoint.keep = 1, 10
    return c
"""


@pytest.mark.slow
def test_the_paper_recipe_runs_on_two_processes_with_async_rollouts_and_the_pre_filter(tmp_path):
    config = tmp_path / "shrunk_rstar2_agent_14b.py"
    config.write_text(CONFIG)
    work = tmp_path / "run"
    args = [sys.executable, "-m", "rstar2_jax.train", f"--config={config}", f"--workdir={work}"]

    # 4 of the 12 problems already pre-filtered (as after a crash mid pre-pass), two solved 2/2
    from rstar2_jax.data.tasks import DataConfig, make_task
    ids = [p.id for p in make_task(DataConfig(train_problems=12, eval_problems=4), seed=0).train_problems]
    (work / "prefilter").mkdir(parents=True)
    seeded = [{"id": i, "solved": n, "k": 2} for i, n in zip(ids[:4], (2, 0, 2, 1))]
    (work / "prefilter" / "stage2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seeded))

    results = launch(args, tmp_path / "first", n=2)
    assert all(status == 0 for status, _, _ in results), [err[-3000:] for _, _, err in results]
    lines = rl_lines(work)
    assert [l["step"] for l in lines] == [0, 1, 2, 3] and [l["stage"] for l in lines] == [0, 0, 1, 2]
    assert all(l["staleness/max"] <= 1 for l in lines) and max(l["staleness/max"] for l in lines) == 1
    assert all(l["kept_rollouts"] == 4 for l in lines)  # both processes' halves gathered: 2 problems x G

    # the pre-filter: each problem once (only the primary process writes), the seeded lines kept,
    # both processes' halves of each problem's k rollouts counted
    rows = [json.loads(l) for l in (work / "prefilter" / "stage2.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(ids) and rows[:4] == seeded
    assert all(0 <= r["solved"] <= 2 for r in rows)
    dropped = {i for i, n in read_results(str(work / "prefilter" / "stage2.jsonl")).items() if n == 2}
    assert {ids[0], ids[2]} <= dropped
    traces = read_traces(work / "traces")
    assert not set(traces[traces["step"] >= 3]["problem_id"]) & dropped
    assert len(traces) == 4 * 2 * 4  # steps x problems x 2G: every rollout traced once, by the primary

    # one more step: the run resumes from its checkpoint on both processes, the pre-filter is not redone
    extended = launch(args + ["--config.rl.steps=5"], tmp_path / "second", n=2)
    assert all(status == 0 for status, _, _ in extended), [err[-3000:] for _, _, err in extended]
    assert "resumed from" in extended[0][1] and "pre-filter" not in extended[0][1]
    assert [l["step"] for l in rl_lines(work)] == [0, 1, 2, 3, 4]
    assert len((work / "prefilter" / "stage2.jsonl").read_text().splitlines()) == len(ids)
    history = [json.loads(l) for l in open(work / "config_history.jsonl")]
    assert [sorted(h["changes"]) for h in history] == [["rl.steps"]]
    assert os.path.exists(work / "checkpoints" / "5")
