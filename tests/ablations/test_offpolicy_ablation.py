"""The off-policy ablation, shrunk: one cell per staleness bound (QUICK_GRID), one seed, 2 RL
steps, on the session's seed-0 warm start, and its notebook."""

import json

import numpy as np
import pytest

from tests.ablations.conftest import ablate, execute, outputs_text, png_count, with_warm_start

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offpolicy_ablation_dir(tmp_path_factory, seed0_warm_start):
    workdir = tmp_path_factory.mktemp("offpolicy")
    with_warm_start(workdir, seed0_warm_start)
    proc = ablate(workdir, "--grid=QUICK_GRID", "--seeds=1", config="experiments/offpolicy_ablation.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def test_offpolicy_ablation_runs_each_correction_at_its_staleness_and_reports_what_it_did(offpolicy_ablation_dir):
    from rstar2_jax.reports import ablation
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
    assert png_count(nb) >= 2
