"""The ablation CLI end to end (grid x seeds, shared warm starts, resume, summary) on a small
FIG4 grid, and the notebooks executed headless against what it produced: a notebook that raises
fails the suite. Notebooks are stored without outputs."""

import json
import os

import nbformat
import numpy as np
import pandas as pd
import pytest

from tests.ablations.conftest import NOTEBOOKS, ablate, execute, outputs_text, with_warm_start

pytestmark = pytest.mark.slow  # a 6-run ablation and two notebooks

CELLS = ["roc_off_4_2_0.001", "roc_paper_4_2_0.001", "roc_release_4_2_0.001"]


def fig4(workdir, *extra):
    return ablate(workdir, "--grid=FIG4", "--seeds=2", "--warm_start_seed=0", *extra)


@pytest.fixture(scope="module")
def ablation_dir(tmp_path_factory, seed0_warm_start):
    """2 seeds x 3 cells of 2 RL steps, every seed from seed 0's warm start: the session's (copied
    in, as a re-run finds it), so the grid trains no SFT. (Each seed's own warm start, the
    default, is the same code with the seed in the key: tests/test_ablate_warm_start.py.)"""
    workdir = tmp_path_factory.mktemp("fig4")
    with_warm_start(workdir, seed0_warm_start)
    proc = fig4(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_ablate_runs_every_cell_and_seed_from_the_one_warm_start_it_was_given(ablation_dir, seed0_warm_start):
    for cell in CELLS:
        for seed in (0, 1):
            run = ablation_dir / cell / f"seed{seed}"
            assert json.loads((run / "cell.json").read_text()) == {"cell": cell, "arg": cell[4:].replace("_", ","),
                                                                     "seed": seed}
            config = json.loads((run / "config.json").read_text())
            assert config["rl"]["steps"] == 2 and config["seed"] == seed and config["sft"]["steps"] == 0
            assert config["rl"]["roc"]["mode"] == cell.split("_")[1]
            assert config["model"]["path"] == str(ablation_dir / "_warm_start" / seed0_warm_start[0] / "model")
            assert (run / "results.json").exists() and sorted(os.listdir(run / "traces"))[-1] == "step_000001.parquet"
    assert os.listdir(ablation_dir / "_warm_start") == [seed0_warm_start[0]]  # no SFT ran: seed 1 shares seed 0's
    for seed in (0, 1):  # one before-RL evaluation per seed (sampling differs): the first cell's, the others share it
        before = [json.loads((ablation_dir / c / f"seed{seed}" / "results.json").read_text())["before"] for c in CELLS]
        assert before[0] == before[1] == before[2]
        rows = [[json.loads(l) for l in open(ablation_dir / c / f"seed{seed}" / "metrics.jsonl")
                 if '"label": "before_rl"' in l] for c in CELLS]
        assert [[r.get("shared", 0) for r in cell_rows] for cell_rows in rows] == [[0], [1], [1]]
        assert rows[1][0]["greedy/accuracy"] == rows[0][0]["greedy/accuracy"]
    assert len(os.listdir(ablation_dir / "_before_rl")) == 2  # one per seed (the seed is in its key)


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
    proc = fig4(ablation_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("finished, skipped") == 6
    assert (ablation_dir / "summary.csv").read_text() == before


def test_ablate_rejects_an_unknown_grid(tmp_path):
    proc = ablate(tmp_path, "--grid=NOPE")
    assert proc.returncode != 0 and "has no non-empty list 'NOPE'" in proc.stderr


def test_explore_traces_notebook_runs_on_a_finished_run(ablation_dir):
    nb = execute("explore_traces.ipynb", {"RSTAR2_RUN": str(ablation_dir / "roc_paper_4_2_0.001" / "seed0")})
    text = outputs_text(nb)
    assert "2 steps, 64 rollouts" in text                        # 2 steps x 4 problems x 8 rollouts
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


def test_a_one_seed_cell_shows_its_value_without_a_spread():
    """Issue 80: a one-seed ablation printed "+- 0.0%", a spread nothing measured."""
    import pandas as pd

    from rstar2_jax.reports.ablation import FINALS, summary_markdown
    row = {"cell": "roc_on", "seeds": 1, **{f"{n}_mean": 0.5 for n in FINALS}, **{f"{n}_std": 0.0 for n in FINALS}}
    two = dict(row, cell="roc_off", seeds=2, **{f"{n}_std": 0.1 for n in FINALS})
    text = summary_markdown(pd.DataFrame([row, two]))
    one_line = next(line for line in text.splitlines() if "roc_on" in line)
    assert "±" not in one_line and "50.0%" in one_line
    assert "50.0% ± 10.0%" in next(line for line in text.splitlines() if "roc_off" in line)


def test_the_grid_eta_is_the_mean_cell_time_times_the_cells_left():
    from rstar2_jax.ablate import grid_eta
    assert grid_eta([600.0, 1200.0], 4).startswith("1h00m for 4 cell(s), about ")


def test_cells_are_named_in_the_plots_by_what_they_are():
    """Issue 80: the plots showed raw cell names (roc_off_4_2_0.001)."""
    from experiments.roc_ablation import GRID, cell_label, get_config
    assert cell_label(get_config("off,4,2,0.001").run_name) == "GRPO, G=4, 2x"
    assert cell_label(get_config("paper,2,2,0.1").run_name) == "GRPO-RoC (paper), G=2, 2x, eps 0.1"
    names = {cell_label(get_config(",".join(map(str, cell))).run_name) for cell in GRID}
    assert len(names) == len(GRID)  # every cell its own label
