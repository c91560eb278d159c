"""The off-policy ablation on the CPU task: corrections x rl.max_staleness, at the demo's budget
(12 steps of 16 problems x 8 rollouts, the same warm start per seed).

    python -m rstar2_jax.ablate --config=experiments/offpolicy_ablation.py --seeds=3 --workdir=runs/offpolicy
    python -m rstar2_jax.train --config=experiments/offpolicy_ablation.py:icepop,1 --workdir=runs/icepop_k1

A cell is `CORRECTION,K`: CORRECTION one of none | token_tis | icepop | geo_mask | decoupled_ppo
(each at its default constants, rl.correction.<name>.*), K the staleness bound. GRID runs every
correction at k = 1 and 2 and the uncorrected run at k = 0, 1, 2; at k = 0 with the float32
embedded engine the sampler is the learner, every correction is the identity (tests/algo's
property, and the learner's bit-identity test), so FULL_GRID's corrected k = 0 cells repeat the
uncorrected one.
"""

from experiments import tiny_arith
from rstar2_jax.reports.ablation import CURVES as BASE_CURVES

CORRECTIONS = ("none", "token_tis", "icepop", "geo_mask", "decoupled_ppo")
CURVES = {  # what `ablate` plots in curves.png
    **BASE_CURVES,
    "staleness/mean": "versions a trained token lags the learner",
    "mismatch/k1_token": "k1 KL(sampler || learner) per token",
    "correction/ess": "effective sample size (fraction)",
    "correction/masked_fraction": "tokens dropped by the correction",
}
GRID = [("none", 0)] + [(c, k) for k in (1, 2) for c in CORRECTIONS if c != "decoupled_ppo"]
FULL_GRID = [(c, k) for k in (0, 1, 2) for c in CORRECTIONS]
QUICK_GRID = [("none", 0), ("token_tis", 1), ("icepop", 2)]  # one cell per k: a quick look (the tests run it)


def get_config(arg: str = "none,1"):
    name, _, k = arg.partition(",")
    if name not in CORRECTIONS or not k.isdigit():
        raise ValueError(f"offpolicy_ablation takes CORRECTION,K with CORRECTION one of {', '.join(CORRECTIONS)} "
                         f"and K >= 0, got {arg!r}")
    c = tiny_arith.get_config()
    c.run_name = f"offpolicy_{name}_k{k}"
    c.rl.max_staleness = int(k)
    c.rl.correction.names = () if name == "none" else (name,)
    return c
