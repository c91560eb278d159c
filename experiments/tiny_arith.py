"""The CPU demo: a tiny Qwen3 learns to use the Python tool for multi-digit arithmetic.

    python -m rstar2_jax.train --config=experiments/tiny_arith.py --workdir=runs/tiny_arith

From nothing: builds the tiny model, SFTs it on synthetic traces (some imperfect: wrong copies,
tool errors then fixes, answers without the tool), then trains with GRPO-RoC on the real sandbox,
and prints accuracy / tool-error ratio / tool calls / length before and after RL.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.run_name = "tiny_arith"

    c.model = ml_collections.ConfigDict()
    c.model.path = ""                    # HF directory; "" builds the tiny random model in the workdir
    c.model.tiny_layers = 2
    c.model.tiny_hidden = 128
    c.model.dtype = "float32"            # compute dtype (params stay float32)
    c.model.remat = "none"
    c.model.attention = "xla"            # full forwards: xla | cudnn (NVIDIA; see BENCHMARKS.md)
    c.model.decode_attention = "xla"     # engine decode: xla | pallas (ragged; needs rollout.max_len % 128 == 0)

    c.data = ml_collections.ConfigDict()
    c.data.task = "arith"                # arith (synthetic multi-digit arithmetic) | jsonl (train_path, eval_path)
    c.data.train_problems = 4000         # arith: how many; jsonl: the first N (0 = all)
    c.data.eval_problems = 200
    c.data.train_path = ""               # jsonl task: problem/answer rows
    c.data.eval_path = ""

    c.format = "tiny"                    # prompt format: tiny (the demo's) | compact | rstar2 (the paper's)

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 350
    c.sft.batch_size = 16
    c.sft.lr = 2e-3
    c.sft.warmup_steps = 30
    c.sft.examples = 4000

    c.rollout = ml_collections.ConfigDict()
    c.rollout.slots = 32
    c.rollout.max_len = 640              # KV per slot: longest prompt + every stage's max_response_tokens must fit
    c.rollout.temperature = 1.0
    c.rollout.tool_timeout_s = 5.0
    c.rollout.engine = "jax"             # jax (embedded) | vllm (servers at vllm_urls; see README)
    c.rollout.reuse_kv = False           # jax: keep a trajectory's KV between turns (prefill only new tokens)
    c.rollout.page_size = 0              # jax: 0 = one max_len KV row per slot; N = paged KV, pages of N positions
    c.rollout.kv_pages = 0               # jax, paged: pages in the pool (0 = slots x max_len / page_size)
    c.rollout.vllm_urls = ()             # server URLs (repeat --config.rollout.vllm_urls=URL); several: the scheduler
    c.rollout.scheduler = "kv_aware"     # kv_aware | round_robin | least_requests (several servers)
    c.rollout.vllm_export_dtype = ""     # dtype of synced weights ("" = the params'); bfloat16 for bf16 servers
    c.rollout.vllm_probe_tolerance = 1e-3  # max |log-prob| gap server vs learner after a sync (raise for bf16)

    c.sandbox = ml_collections.ConfigDict()
    c.sandbox.workers = 2
    c.sandbox.isolation = "strict"
    c.sandbox.tool_state = "stateless"  # or "session": a live interpreter per trajectory (beyond the release)

    c.rl = ml_collections.ConfigDict()
    c.rl.steps = 12
    c.rl.batch_problems = 16
    c.rl.group_size = 4                  # G kept per problem
    c.rl.oversample = 2                  # 2G rollouts per problem
    c.rl.lr = 2e-4
    c.rl.warmup_steps = 2
    c.rl.weight_decay = 0.0
    c.rl.grad_clip = 1.0
    c.rl.micro_batches = 1
    c.rl.advantage = "grpo"
    c.rl.token_entropy = True            # per-token entropies of kept rollouts into the traces (learner pass)
    c.rl.max_staleness = 0               # async rollouts: versions a sampled token may lag the learner (0: on-policy, the paper)
    c.rl.tis_cap = 0.0                   # truncated importance sampling sampler -> learner, cap (0: off, the paper)
    c.rl.roc = ml_collections.ConfigDict()
    c.rl.roc.mode = "paper"              # paper | release | off
    c.rl.roc.eps = 1e-3
    c.rl.roc.min_neg = 2
    c.rl.roc.min_pos = 2
    c.rl.roc.reject_uniform_groups = True
    c.rl.loss = ml_collections.ConfigDict()
    c.rl.loss.name = "clip_higher"
    c.rl.loss.eps_low = 0.2
    c.rl.loss.eps_high = 0.28
    c.rl.loss.dual_clip = ml_collections.config_dict.placeholder(float)

    # Stages: from `start_step`, these rollout limits apply (the token budget covers all turns).
    # `filter_solved_k` (0 = off) drops problems the policy solves k/k: filter_mode "offline" is
    # the paper's pre-pass (k rollouts of every training problem when the stage begins, results in
    # the run dir, resumable), "online" drops a problem when the first k of its rollouts in a step
    # all score. `reset_optimizer` at the stage's first step.
    c.stages = [dict(start_step=0, max_response_tokens=400, max_turns=4, filter_solved_k=0, filter_mode="offline", reset_optimizer=False)]

    c.eval = ml_collections.ConfigDict()
    c.eval.before_and_after = True

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))  # used when more than one device
    c.distributed = False                # jax.distributed.initialize() (multi-host)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 4
    c.checkpoint.keep = 2
    return c
