"""The algorithm ablation, shrunk: its 7 cells, one seed, one RL step each (what the test checks of
a cell, its settings in force, shows in its first step: a second cost the grid 7 x ~3 s), on the
session's seed-0 warm start (the same model, data and SFT settings: a copy of it, no second SFT),
and its notebook."""

import json
import os

import pytest

from tests.ablations.conftest import ablate, execute, outputs_text, png_count, with_warm_start

pytestmark = pytest.mark.slow

ALGORITHM_CELLS = ["alg_grpo_roc", "alg_grpo", "alg_grpo_dynamic", "alg_gspo", "alg_dr_grpo", "alg_grpo_roc_kl",
                   "alg_grpo_roc_4x2"]


@pytest.fixture(scope="module")
def algorithm_ablation_dir(tmp_path_factory, seed0_warm_start):
    workdir = tmp_path_factory.mktemp("algorithms")
    with_warm_start(workdir, seed0_warm_start)
    proc = ablate(workdir, "--seeds=1", "--config.rl.steps=1", config="experiments/algorithm_ablation.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_algorithm_ablation_runs_every_variant_with_its_own_settings(algorithm_ablation_dir, seed0_warm_start):
    lines = {}
    for cell in ALGORITHM_CELLS:
        run = algorithm_ablation_dir / cell / "seed0"
        assert (run / "results.json").exists()
        lines[cell] = [json.loads(l) for l in open(run / "metrics.jsonl") if '"phase": "rl"' in l]
        assert [m["step"] for m in lines[cell]] == [0]
    # the copied warm start only: no SFT ran (its key is the FIG4 grid's: the same model, data and SFT)
    assert os.listdir(algorithm_ablation_dir / "_warm_start") == [seed0_warm_start[0]]
    # the cells differ only in rl.*: the first evaluated before RL, the other six share its evaluation
    shared = [[json.loads(l).get("shared", 0) for l in open(algorithm_ablation_dir / c / "seed0" / "metrics.jsonl")
               if '"label": "before_rl"' in l] for c in ALGORITHM_CELLS]
    assert shared == [[0]] + [[1]] * 6 and len(os.listdir(algorithm_ablation_dir / "_before_rl")) == 1
    trained = {c: [m for m in ms if "optimizer_steps" in m] for c, ms in lines.items()}
    assert all(m["optimizer_steps"] == 1 for m in trained["alg_grpo_roc"])
    assert all(m["optimizer_steps"] > 1 for m in trained["alg_grpo_roc_4x2"])      # several steps per batch
    assert all("kl_ref_k3" in m for m in trained["alg_grpo_roc_kl"])
    assert not any("kl_ref_k3" in m for m in trained["alg_grpo_roc"])
    assert all("dynamic_sampling/problems_drawn" in m for m in lines["alg_grpo_dynamic"])
    config = json.loads((algorithm_ablation_dir / "alg_dr_grpo" / "seed0" / "config.json").read_text())
    assert config["rl"]["advantage"]["name"] == "mean_only" and config["rl"]["loss"]["aggregation"] == "constant"
    assert "gspo" == json.loads((algorithm_ablation_dir / "alg_gspo" / "seed0" / "config.json").read_text()
                                )["rl"]["loss"]["name"]
    assert (algorithm_ablation_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_algorithm_ablation_notebook_runs_on_the_ablation(algorithm_ablation_dir):
    nb = execute("algorithm_ablation.ipynb", {"RSTAR2_ABLATION": str(algorithm_ablation_dir)})
    assert all(cell in outputs_text(nb) for cell in ALGORITHM_CELLS)
    assert png_count(nb) >= 3
