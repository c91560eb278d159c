"""The algorithm ablation on the CPU task: GRPO-RoC as in the paper against the variants a
reviewer asks for, each at the demo's budget (12 steps of 16 problems x 8 rollouts).

    python -m rstar2_jax.ablate --config=experiments/algorithm_ablation.py --seeds=3 --workdir=runs/algorithms
    python -m rstar2_jax.train --config=experiments/algorithm_ablation.py:gspo --workdir=runs/gspo   # one cell

Cells (`get_config(NAME)`; GRID lists them in this order):
    grpo_roc         the paper: RoC (paper mode), clip-higher 0.2 / 0.28, token-mean, one update per batch
    grpo             plain GRPO: uniform selection of G of the 2G rollouts (rl.roc.mode=off)
    grpo_dynamic     plain GRPO + DAPO's dynamic sampling (draw until 16 informative groups, at most 64
                     problems) and overlong shaping (the last 80 of 400 tokens)
    gspo             plain GRPO selection, GSPO's sequence-level ratio and clip (3e-4 / 4e-4)
    dr_grpo          plain GRPO selection, advantages r - mean, sum / (sequences x 400)
    grpo_roc_kl      the paper + a k3 KL term to the post-SFT weights, coefficient 0.01
    grpo_roc_4x2     the paper with 4 mini-batches x 2 epochs per step (8 optimizer steps; the clip binds)
"""

from experiments import tiny_arith
from rstar2_jax.reports.ablation import ALGORITHM_CURVES

CURVES = ALGORITHM_CURVES  # what `ablate` plots in curves.png


def _grpo_roc(c):
    pass


def _grpo(c):
    c.rl.roc.mode = "off"


def _grpo_dynamic(c):
    _grpo(c)
    c.rl.dynamic_sampling.enabled = True
    c.rl.dynamic_sampling.max_problems = 4 * c.rl.batch_problems
    c.rl.overlong.cache_tokens = 80


def _gspo(c):
    _grpo(c)
    c.rl.loss.name = "gspo"


def _dr_grpo(c):
    _grpo(c)
    c.rl.advantage.name = "mean_only"
    c.rl.loss.aggregation = "constant"   # C = the stage's max_response_tokens (rl.loss.constant_tokens=0)


def _grpo_roc_kl(c):
    c.rl.kl.coef = 0.01
    c.rl.kl.estimator = "k3"


def _grpo_roc_4x2(c):
    c.rl.mini_batches = 4
    c.rl.epochs = 2


CELLS = {"grpo_roc": _grpo_roc, "grpo": _grpo, "grpo_dynamic": _grpo_dynamic, "gspo": _gspo, "dr_grpo": _dr_grpo,
         "grpo_roc_kl": _grpo_roc_kl, "grpo_roc_4x2": _grpo_roc_4x2}
GRID = [(name,) for name in CELLS]


def get_config(arg: str = "grpo_roc"):
    if arg not in CELLS:
        raise ValueError(f"algorithm_ablation takes one of {', '.join(CELLS)}, got {arg!r}")
    c = tiny_arith.get_config()
    c.run_name = f"alg_{arg}"
    CELLS[arg](c)
    return c
