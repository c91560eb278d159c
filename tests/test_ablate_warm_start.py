"""Which SFT warm start each run of an ablation grid starts RL from (`ablate.warm_start_config`
and its key): by default each seed its own, with `--warm_start_seed=K` seed K's for every seed.
The FIG4 system test (tests/ablations/test_roc_ablation.py) runs the shared case end to end."""

import pytest

from rstar2_jax import ablate

CONFIG = "experiments/roc_ablation.py"


@pytest.fixture(scope="module")
def fig4_runs(tmp_path_factory):
    return ablate.plan(CONFIG, "FIG4", 3, {}, str(tmp_path_factory.mktemp("fig4")))


def keys(runs, warm_start_seed):
    return {(cfg.run_name, seed): ablate.warm_start_key(ablate.warm_start_config(cfg, warm_start_seed))
            for _, seed, cfg, _ in runs}


def test_by_default_each_seed_has_its_own_warm_start_shared_by_its_cells(fig4_runs):
    by_run = keys(fig4_runs, None)
    per_seed = {seed: {k for (_, s), k in by_run.items() if s == seed} for seed in (0, 1, 2)}
    assert all(len(k) == 1 for k in per_seed.values())          # the cells of a seed share one
    assert len(set().union(*per_seed.values())) == 3            # the seeds do not


@pytest.mark.parametrize("warm_start_seed", [0, 2])
def test_warm_start_seed_gives_every_seed_that_seeds_warm_start(fig4_runs, warm_start_seed):
    shared = set(keys(fig4_runs, warm_start_seed).values())
    own = keys(fig4_runs, None)
    assert shared == {k for (_, s), k in own.items() if s == warm_start_seed}


def test_warm_start_seed_leaves_the_runs_own_seed_alone(fig4_runs):
    for _, seed, cfg, _ in fig4_runs:
        assert ablate.warm_start_config(cfg, 0).seed == 0 and cfg.seed == seed
