"""The RoC ablation grid on the CPU task: selection mode x (group, oversample).

    python -m rstar2_jax.train --config=experiments/roc_ablation.py:off,4,2 --workdir=runs/roc_off_4_2

`get_config("MODE,G,OVERSAMPLE")` gives one cell; `GRID` lists them all.
"""

from experiments import tiny_arith

GRID = [(mode, g, o) for mode in ("off", "paper", "release") for g, o in ((4, 2), (2, 2), (4, 1))]


def get_config(arg: str = "paper,4,2"):
    mode, g, o = arg.split(",")
    c = tiny_arith.get_config()
    c.run_name = f"roc_{mode}_{g}_{o}"
    c.rl.roc.mode = mode
    c.rl.group_size = int(g)
    c.rl.oversample = int(o)
    return c
