"""LoRA against full fine-tuning on the CPU task: GRPO-RoC (the paper's settings, the demo's budget:
12 steps of 16 problems x 8 rollouts) with the adapters at rank 1, 8 and 32 on every projection,
against training every parameter. Every cell of a seed starts RL from the same full SFT warm
start (ablate shares it; fresh adapters start at zero on it).

    python -m rstar2_jax.ablate --config=experiments/lora_ablation.py --seeds=3 --workdir=runs/lora
    python -m rstar2_jax.train --config=experiments/lora_ablation.py:lora_r8 --workdir=runs/lora_r8   # one cell

The adapters' learning rate is 10x the full run's (2e-3 against 2e-4): "LoRA Without Regret"
(Thinking Machines, 2025) finds LoRA's best learning rate about 10x full fine-tuning's, across
ranks, for supervised and RL training. alpha = 32 for every rank (their setting too: with alpha
fixed, the learning rate that is best barely moves with the rank).
"""

from experiments import tiny_arith

RANKS = {"full": 0, "lora_r1": 1, "lora_r8": 8, "lora_r32": 32}
GRID = [(name,) for name in RANKS]
LORA_LR = 2e-3


def get_config(arg: str = "lora_r8"):
    if arg not in RANKS:
        raise ValueError(f"lora_ablation takes one of {', '.join(RANKS)}, got {arg!r}")
    c = tiny_arith.get_config()
    c.run_name = f"lora_{arg}" if arg == "full" else arg
    if RANKS[arg]:
        c.model.lora.rank = RANKS[arg]
        c.model.lora.alpha = 32.0
        c.rl.lr = LORA_LR
    return c
