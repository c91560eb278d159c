"""The paper's recipe, as written in rStar2-Agent (arXiv 2508.20722), for Qwen3-14B-Base after the
non-reasoning SFT stage, on 64 GPUs.

512 prompts x 32 rollouts -> 16 kept (RoC); lr 1e-6 (AdamW, 20-step warm-up, then constant);
temperature 1.0; no KL, no entropy; clip-higher 0.2 / 0.28; stage 1: 8K tokens, 10 turns, to
step 300; stage 2: 12K tokens to step 385; stage 3: 12K tokens, 15 turns, problems the policy
solves 8/8 dropped, optimizer reset, to step 510.

    python -m rstar2_jax.train --config=experiments/rstar2_agent_14b.py:/ckpt/qwen3-14b-sft,/data/train.jsonl \
        --workdir=/runs/rstar2_14b --config.distributed=True
"""

from experiments import qwen3_0p6b_math


def get_config(arg: str = ""):
    c = qwen3_0p6b_math.get_config(arg)  # the GPU math recipe (base_config + a HF model, JSONL problems, bf16)
    c.run_name = "rstar2_agent_14b"
    c.distributed = True
    c.mesh.data = 1
    c.mesh.fsdp = 16
    c.mesh.tensor = 4                    # 64 GPUs: FSDP 16 x tensor 4
    c.mesh.devices_per_process = 8       # one trainer process per 8-GPU host
    c.model.decode_attention = "xla"     # over the host's 8 GPUs by heads (Pallas does too: not yet measured there)
    c.rollout.jax.page_size = 256
    c.rollout.jax.kv_memory_gb = 160.0       # 20 GiB of KV per GPU (train --plan prints the whole budget)
    c.rollout.max_len = 12288 + 1024
    c.rollout.temperature = 1.0
    c.rl.steps = 510
    c.rl.batch_problems = 512
    c.rl.group_size = 16
    c.rl.oversample = 2
    c.rl.lr = 1e-6
    c.rl.warmup_steps = 20
    c.rl.token_budget = -1               # auto: packed rows, the largest budget the plan fits (train --plan names it)
    c.rl.micro_batches = 1               # the micro-batches follow from the tokens (padded rows: 128 fit)
    c.rl.roc.mode = "paper"
    c.stages = [
        dict(start_step=0, max_response_tokens=8192, max_turns=10, filter_solved_k=0, filter_mode="offline", reset_optimizer=False),
        dict(start_step=300, max_response_tokens=12288, max_turns=10, filter_solved_k=0, filter_mode="offline", reset_optimizer=False),
        dict(start_step=385, max_response_tokens=12288, max_turns=15, filter_solved_k=8, filter_mode="offline", reset_optimizer=True),
    ]
    c.sandbox.local.workers = 64               # or sandbox.backend=redis: workers on CPU hosts (SCALING.md)
    c.checkpoint.every = 10
    c.checkpoint.keep = 5
    return c
