"""One GPU: GRPO-RoC on a local Qwen3-0.6B checkpoint (already SFT'd for the tool format) and a
JSONL math set.

    python -m rstar2_jax.train --config=experiments/qwen3_0p6b_math.py:/path/to/qwen3-0.6b,/path/train.jsonl \
        --workdir=runs/qwen3_0p6b --config.data.problems.eval_path=/path/to/aime24.jsonl
"""

from rstar2_jax.rl.config import base_config


def get_config(arg: str = ""):
    model_path, _, train_jsonl = (arg or ",").partition(",")
    c = base_config()
    c.run_name = "qwen3_0p6b_math"
    c.model.path = model_path
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.attention = "cudnn"          # NVIDIA GPUs; "xla" elsewhere (AMD, CPU)
    c.model.decode_attention = "pallas"
    c.format = "rstar2"
    c.data.task = "problems"
    c.data.problems.train_path = train_jsonl or "train.jsonl"
    c.data.train_problems = 0            # all
    c.data.eval_problems = 0
    c.data.problems.eval_path = "aime24.jsonl"    # set --config.data.problems.eval_path
    c.sft.steps = 0
    c.rollout.jax.slots = 64
    c.rollout.max_len = 8192 + 1024
    c.rollout.jax.page_size = 256            # paged KV, sized by memory rather than slots x max_len
    c.rollout.jax.kv_memory_gb = 16.0        # train --plan: fits one 80 GB GPU (JAX at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95)
    c.rl.steps = 300
    c.rl.batch_problems = 32
    c.rl.group_size = 8
    c.rl.oversample = 2
    c.rl.lr = 1e-6
    c.rl.warmup_steps = 20
    c.rl.token_budget = -1               # auto: packed rows, the largest budget the plan fits (train --plan names it)
    c.rl.micro_batches = 1               # the micro-batches follow from the tokens (padded rows: 32 fit an 80 GB GPU)
    c.stages = [dict(start_step=0, max_response_tokens=8192, max_turns=10, filter_solved_k=0, filter_mode="offline",
                     reset_optimizer=False)]
    c.sandbox.local.workers = 32
    c.checkpoint.every = 20
    return c
