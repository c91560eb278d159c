"""The CPU demo: a tiny Qwen3 learns to use the Python tool for multi-digit arithmetic.

    python -m rstar2_jax.train --config=experiments/tiny_arith.py --workdir=runs/tiny_arith

From nothing: builds the tiny model, SFTs it on synthetic traces (some imperfect: wrong copies,
tool errors then fixes, answers without the tool), then trains with GRPO-RoC on the real sandbox,
and prints accuracy / tool-error ratio / tool calls / length before and after RL.

Every field and its meaning: `python -m rstar2_jax.train --config=experiments/tiny_arith.py --helpconfig`.
"""

from rstar2_jax.rl.config import base_config


def get_config():
    c = base_config()
    c.run_name = "tiny_arith"
    c.model.path = ""                    # the tiny random model, built in the run directory
    c.model.tiny_layers = 2
    c.model.tiny_hidden = 128
    c.data.task = "arith"
    c.data.train_problems = 4000
    c.data.eval_problems = 200
    c.format = "tiny"
    c.sft.steps = 350                    # a warm start on the task's synthetic traces
    c.rollout.jax.slots = 32
    c.rollout.max_len = 640
    c.sandbox.local.workers = 2
    c.rl.steps = 12
    c.rl.batch_problems = 16
    c.rl.group_size = 4
    c.rl.oversample = 2
    c.rl.lr = 2e-4
    c.rl.warmup_steps = 2
    c.stages = [dict(start_step=0, max_response_tokens=400, max_turns=4, filter_solved_k=0, filter_mode="offline",
                     reset_optimizer=False)]
    c.checkpoint.every = 4
    c.checkpoint.keep = 2
    return c
