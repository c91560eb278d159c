"""The RoC ablation grid on the CPU task: selection mode x (kept group G, oversampling) x eps.

    python -m rstar2_jax.train --config=experiments/roc_ablation.py:off,4,2,0.001 --workdir=runs/roc_off_4_2

    python -m rstar2_jax.ablate --config=experiments/roc_ablation.py --seeds=3 --workdir=runs/roc_ablation
    python -m rstar2_jax.ablate --config=experiments/roc_ablation.py --grid=FIG4 --seeds=3 --workdir=runs/fig4

`get_config("MODE,G,OVERSAMPLE[,EPS]")` gives one cell; `GRID` lists them all (eps is the paper
mode's, rl.roc.paper.eps: plain GRPO draws uniformly and the release sorts by penalty); `FIG4`
is the paper's Fig. 4 comparison at toy scale: plain GRPO against GRPO-RoC as in the paper and
as in the released code.
"""

from experiments import tiny_arith

GRID = ([(mode, g, o, 1e-3) for mode in ("off", "release") for g, o in ((4, 2), (2, 2), (4, 1))]
        + [("paper", g, o, eps) for g, o in ((4, 2), (2, 2), (4, 1)) for eps in (1e-3, 0.1)])
FIG4 = [("off", 4, 2, 1e-3), ("paper", 4, 2, 1e-3), ("release", 4, 2, 1e-3)]


def get_config(arg: str = "paper,4,2,0.001"):
    parts = arg.split(",")
    if len(parts) not in (3, 4):
        raise ValueError(f"roc_ablation config takes MODE,G,OVERSAMPLE[,EPS], got {arg!r}")
    mode, g, o = parts[0], int(parts[1]), int(parts[2])
    eps = float(parts[3]) if len(parts) == 4 else 1e-3
    c = tiny_arith.get_config()
    c.run_name = f"roc_{mode}_{g}_{o}_{eps:g}"
    c.rl.roc.mode = mode
    if mode == "paper":
        c.rl.roc.paper.eps = eps
    elif eps != 1e-3:
        raise ValueError(f"eps={eps} is the paper mode's (rl.roc.paper.eps); mode {mode!r} does not read it")
    c.rl.group_size = g
    c.rl.oversample = o
    return c


_MODES = {"off": "GRPO", "paper": "GRPO-RoC (paper)", "release": "GRPO-RoC (release)"}


def cell_label(run_name: str) -> str:
    """A cell as the plots name it: roc_paper_4_2_0.001 -> "GRPO-RoC (paper), G=4, 2x, eps 0.001"."""
    _, mode, g, o, eps = run_name.split("_")
    return f"{_MODES.get(mode, mode)}, G={g}, {o}x" + (f", eps {eps}" if mode == "paper" else "")
