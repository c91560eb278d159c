"""Every experiment config builds and passes validation (paths aside)."""

import pytest

from experiments import qwen3_0p6b_math, roc_ablation, rstar2_agent_14b, tiny_arith
from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.rl.config import validate


def test_tiny_arith_validates():
    validate(tiny_arith.get_config())


@pytest.mark.parametrize("cell", roc_ablation.GRID)
def test_roc_grid_cells_validate(cell):
    cfg = roc_ablation.get_config(",".join(map(str, cell)))
    validate(cfg)
    assert (cfg.rl.roc.mode, cfg.rl.group_size, cfg.rl.oversample, cfg.rl.roc.paper.eps) == cell


def test_paper_recipe_matches_the_paper(tmp_path):
    c = rstar2_agent_14b.get_config("")
    (tmp_path / "problems.jsonl").write_text('{"problem": "1+1", "answer": 2}\n')
    c.data.problems.train_path = c.data.problems.eval_path = str(tmp_path / "problems.jsonl")  # the paths are the user's
    assert (c.rl.batch_problems, c.rl.group_size * c.rl.oversample, c.rl.group_size) == (512, 32, 16)
    assert c.rl.lr == 1e-6 and c.rollout.temperature == 1.0 and c.rl.steps == 510
    assert [(s.start_step, s.max_response_tokens, s.max_turns, s.filter_solved_k, s.reset_optimizer)
            for s in validate(c, processes_count=1).stages] == [(0, 8192, 10, 0, False), (300, 12288, 10, 0, False),
                                                                (385, 12288, 15, 8, True)]
    assert c.mesh.fsdp * c.mesh.tensor * c.mesh.data == 64 and c.distributed


def test_a_model_path_must_be_a_hf_directory(tmp_path):
    c = qwen3_0p6b_math.get_config(f"{tmp_path},{tmp_path / 'missing.jsonl'}")
    with pytest.raises(ConfigValueError, match="model.path: .* is not a HF model directory"):
        validate(c)


def test_jsonl_configs_need_their_files(tmp_path):
    c = qwen3_0p6b_math.get_config(f",{tmp_path / 'missing.jsonl'}")  # model.path "": the tiny model
    with pytest.raises(ConfigValueError, match="data.problems.train_path: no such file"):
        validate(c)
    (tmp_path / "train.jsonl").write_text('{"problem": "1+1", "answer": 2}\n')
    c.data.problems.train_path = str(tmp_path / "train.jsonl")
    with pytest.raises(ConfigValueError, match="data.problems.eval_path: no such file"):
        validate(c)
    c.data.problems.eval_path = c.data.problems.train_path
    validate(c)


def test_rollout_seeds_are_the_same_in_every_process():
    import os
    import subprocess
    import sys

    from rstar2_jax.core.seeding import stable_seed

    code = "from rstar2_jax.core.seeding import stable_seed; print(stable_seed(0, 'before_rl', 'greedy', 3))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONHASHSEED="12345"), check=True).stdout
    assert int(out) == stable_seed(0, "before_rl", "greedy", 3) and 0 <= int(out) < 2 ** 31
