"""The ablation CLI end to end (grid x seeds, shared warm starts, resume, summary) on a small
FIG4 grid, and both notebooks executed headless against what it produced: a notebook that raises
fails the suite. Notebooks are stored without outputs."""

import json
import os
import subprocess
import sys

import nbformat
import numpy as np
import pandas as pd
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # a 6-run ablation and two notebooks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
CELLS = ["roc_off_4_2_0.001", "roc_paper_4_2_0.001", "roc_release_4_2_0.001"]
# big enough for the SFT'd policy to solve some problems (so runs have positives, negatives and
# RoC choices), small enough for the suite: 2 warm starts + 6 runs of 3 RL steps
SMALL = ["--config.sft.steps=200", "--config.rl.steps=3", "--config.rl.batch_problems=4",
         "--config.data.eval_problems=16", "--config.checkpoint.every=3"]


def ablate(workdir, *extra):
    return subprocess.run([sys.executable, "-m", "rstar2_jax.ablate", "--config=experiments/roc_ablation.py",
                           "--grid=FIG4", "--seeds=2", f"--workdir={workdir}", *SMALL, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def ablation_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fig4")
    proc = ablate(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_ablate_runs_every_cell_and_seed_from_one_warm_start_per_seed(ablation_dir):
    for cell in CELLS:
        for seed in (0, 1):
            run = ablation_dir / cell / f"seed{seed}"
            assert json.loads((run / "cell.json").read_text()) == {"cell": cell, "arg": cell[4:].replace("_", ","),
                                                                     "seed": seed}
            config = json.loads((run / "config.json").read_text())
            assert config["rl"]["steps"] == 3 and config["seed"] == seed and config["sft"]["steps"] == 0
            assert config["rl"]["roc"]["mode"] == cell.split("_")[1]
            assert (run / "results.json").exists() and sorted(os.listdir(run / "traces"))[-1] == "step_000002.parquet"
    assert len(os.listdir(ablation_dir / "_warm_start")) == 2
    for seed in (0, 1):  # the same warm start and evaluation seeds: the same policy before RL in every cell
        before = [json.loads((ablation_dir / c / f"seed{seed}" / "results.json").read_text())["before"] for c in CELLS]
        assert before[0] == before[1] == before[2]


def test_ablate_summary_is_mean_and_spread_over_seeds(ablation_dir):
    runs = pd.read_csv(ablation_dir / "runs.csv")
    summary = pd.read_csv(ablation_dir / "summary.csv").set_index("cell")
    assert list(summary.index) == CELLS and (summary["seeds"] == 2).all()
    for cell in CELLS:
        for metric in ("greedy_accuracy", "sampled_accuracy", "tool_error_ratio_correct", "mean_response_tokens"):
            values = [json.loads((ablation_dir / cell / f"seed{s}" / "results.json").read_text())["after"]
                      ["greedy" if metric == "greedy_accuracy" else "sampled"]
                      [{"greedy_accuracy": "accuracy", "sampled_accuracy": "accuracy"}.get(metric, metric)]
                      for s in (0, 1)]
            assert sorted(runs[runs.cell == cell][metric]) == pytest.approx(sorted(values))
            assert summary.loc[cell, f"{metric}_mean"] == pytest.approx(np.mean(values))
            assert summary.loc[cell, f"{metric}_std"] == pytest.approx(np.std(values, ddof=1))
    table = (ablation_dir / "summary.md").read_text()
    assert all(f"| {cell} | 2 |" in table for cell in CELLS)
    for png in ("curves.png", "finals.png"):
        assert (ablation_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablate_rerun_skips_finished_runs_and_rewrites_the_same_summary(ablation_dir):
    before = (ablation_dir / "summary.csv").read_text()
    proc = ablate(ablation_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("finished, skipped") == 6
    assert (ablation_dir / "summary.csv").read_text() == before


def test_ablate_rejects_an_unknown_grid(tmp_path):
    proc = ablate(tmp_path, "--grid=NOPE")
    assert proc.returncode != 0 and "has no non-empty list 'NOPE'" in proc.stderr


def execute(name, env):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the environment
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb


def outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def test_explore_traces_notebook_runs_on_a_finished_run(ablation_dir):
    nb = execute("explore_traces.ipynb", {"RSTAR2_RUN": str(ablation_dir / "roc_paper_4_2_0.001" / "seed0")})
    text = outputs_text(nb)
    assert "3 steps, 96 rollouts" in text                        # 3 steps x 4 problems x 8 rollouts
    assert "turn 0" in text and "tool" in text                   # the trajectory viewer rendered
    assert "reflection_share" in text and "forking" in text      # the entropy section ran on real entropies
    assert any(o.get("data", {}).get("image/png") for c in nb.cells for o in c.get("outputs", []))


def test_roc_ablation_notebook_runs_on_the_ablation(ablation_dir):
    text = outputs_text(execute("roc_ablation.ipynb", {"RSTAR2_ABLATION": str(ablation_dir)}))
    assert all(cell in text for cell in CELLS) and "± " in text


@pytest.mark.parametrize("name", ["explore_traces.ipynb", "roc_ablation.ipynb", "algorithm_ablation.ipynb",
                                  "offpolicy_ablation.ipynb"])
def test_notebooks_are_stored_without_outputs(name):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


# The algorithm ablation, shrunk: its 7 cells, one seed, 2 RL steps, on the FIG4 fixture's seed-0
# warm start (the same model, data and SFT settings: a copy of it, no second SFT).
ALGORITHM_CELLS = ["alg_grpo_roc", "alg_grpo", "alg_grpo_dynamic", "alg_gspo", "alg_dr_grpo", "alg_grpo_roc_kl",
                   "alg_grpo_roc_4x2"]


@pytest.fixture(scope="module")
def algorithm_ablation_dir(ablation_dir, tmp_path_factory):
    import shutil
    workdir = tmp_path_factory.mktemp("algorithms")
    shutil.copytree(ablation_dir / "_warm_start", workdir / "_warm_start")
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.ablate", "--config=experiments/algorithm_ablation.py",
                           "--seeds=1", f"--workdir={workdir}", *SMALL, "--config.rl.steps=2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_algorithm_ablation_runs_every_variant_with_its_own_settings(algorithm_ablation_dir, ablation_dir):
    lines = {}
    for cell in ALGORITHM_CELLS:
        run = algorithm_ablation_dir / cell / "seed0"
        assert (run / "results.json").exists()
        lines[cell] = [json.loads(l) for l in open(run / "metrics.jsonl") if '"phase": "rl"' in l]
        assert [m["step"] for m in lines[cell]] == [0, 1]
    assert sorted(os.listdir(algorithm_ablation_dir / "_warm_start")) == sorted(    # the copied ones: no SFT ran
        os.listdir(ablation_dir / "_warm_start"))
    trained = {c: [m for m in ms if "optimizer_steps" in m] for c, ms in lines.items()}
    assert all(m["optimizer_steps"] == 1 for m in trained["alg_grpo_roc"])
    assert all(m["optimizer_steps"] > 1 for m in trained["alg_grpo_roc_4x2"])      # several steps per batch
    assert all("kl_ref_k3" in m for m in trained["alg_grpo_roc_kl"])
    assert not any("kl_ref_k3" in m for m in trained["alg_grpo_roc"])
    assert all("dynamic_sampling/problems_drawn" in m for m in lines["alg_grpo_dynamic"])
    config = json.loads((algorithm_ablation_dir / "alg_dr_grpo" / "seed0" / "config.json").read_text())
    assert config["rl"]["advantage"] == "mean_only" and config["rl"]["loss"]["aggregation"] == "constant"
    assert "gspo" == json.loads((algorithm_ablation_dir / "alg_gspo" / "seed0" / "config.json").read_text()
                                )["rl"]["loss"]["name"]
    assert (algorithm_ablation_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_algorithm_ablation_notebook_runs_on_the_ablation(algorithm_ablation_dir):
    nb = execute("algorithm_ablation.ipynb", {"RSTAR2_ABLATION": str(algorithm_ablation_dir)})
    text = outputs_text(nb)
    assert all(cell in text for cell in ALGORITHM_CELLS)
    assert sum(bool(o.get("data", {}).get("image/png")) for c in nb.cells for o in c.get("outputs", [])) >= 3


# The off-policy ablation, shrunk: one cell per staleness bound (QUICK_GRID), one seed, 2 RL steps,
# on the FIG4 fixture's seed-0 warm start.
@pytest.fixture(scope="module")
def offpolicy_ablation_dir(ablation_dir, tmp_path_factory):
    import shutil
    workdir = tmp_path_factory.mktemp("offpolicy")
    shutil.copytree(ablation_dir / "_warm_start", workdir / "_warm_start")
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.ablate", "--config=experiments/offpolicy_ablation.py",
                           "--grid=QUICK_GRID", "--seeds=1", f"--workdir={workdir}", *SMALL, "--config.rl.steps=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_offpolicy_ablation_runs_each_correction_at_its_staleness_and_reports_what_it_did(offpolicy_ablation_dir):
    from rstar2_jax import ablation
    table = ablation.staleness_table(str(offpolicy_ablation_dir)).set_index("correction")
    assert sorted(table.index) == ["icepop", "none", "token_tis"]
    assert table.loc["none", "k"] == 0 and table.loc["token_tis", "k"] == 1 and table.loc["icepop", "k"] == 2
    for cell, k in (("offpolicy_token_tis_k1", 1), ("offpolicy_icepop_k2", 2)):
        lines = [json.loads(l) for l in open(offpolicy_ablation_dir / cell / "seed0" / "metrics.jsonl")
                 if '"phase": "rl"' in l]
        assert all(m["staleness/max"] <= k for m in lines)
        trained = [m for m in lines if "optimizer_steps" in m]
        assert trained and all(0 < m["correction/ess"] <= 1 and "mismatch/k3_token" in m for m in trained)
    assert np.isnan(table.loc["none", "correction/ess"])  # no correction: nothing to weigh
    assert (offpolicy_ablation_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offpolicy_ablation_notebook_runs_on_the_ablation(offpolicy_ablation_dir):
    nb = execute("offpolicy_ablation.ipynb", {"RSTAR2_ABLATION": str(offpolicy_ablation_dir)})
    text = outputs_text(nb)
    assert all(cell in text for cell in ("offpolicy_none_k0", "offpolicy_token_tis_k1", "offpolicy_icepop_k2"))
    assert sum(bool(o.get("data", {}).get("image/png")) for c in nb.cells for o in c.get("outputs", [])) >= 2
