"""The memory plan (`train --plan`, and the check before launch) against hand-computed figures for
Qwen3-0.6B, 1.7B and 14B in the repo's recipes, and a run that cannot fit refused before any
weight is loaded. The hand computations follow rl/memory_plan.py's docstring term by term."""

import json
import os
import dataclasses
import subprocess
import sys

import pytest

from experiments import qwen3_0p6b_math, rstar2_agent_14b
from rstar2_jax.models.shapes import shape
from rstar2_jax.rl.config import RunConfig
from rstar2_jax.rl.memory_plan import GiB, memory_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(recipe, tmp_path, **overrides) -> RunConfig:
    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    c = recipe.get_config(f",{data}")
    c.data.problems.eval_path = str(data)
    for key, value in overrides.items():
        *sections, field = key.split("__")
        node = c
        for name in sections:
            node = node[name]
        setattr(node, field, value)
    cfg, problems = RunConfig.parse(c.to_dict())
    assert not problems, problems
    return cfg


def test_qwen3_14b_on_64_gpus_hand_computed(tmp_path):
    # padded rows in 128 micro-batches (the recipe packs by default: below)
    plan = memory_plan(shape("qwen3_14b"), _cfg(rstar2_agent_14b, tmp_path, rl__token_budget=0, rl__micro_batches=128),
                       devices=64, devices_per_process=8, capacity=76 * GiB)
    # 14,768,307,200 parameters; the norms (40 layers x (2 x 5120 + 2 x 128) + 5120 = 424,960) stay whole,
    # every matrix splits 64 ways (FSDP 16 x tensor 4: 40 heads, 8 KV heads, 17,408, 151,936 all divide).
    params = ((14_768_307_200 - 424_960) // 64 + 424_960) * 4
    assert plan.line("parameters").bytes == params == 924_692_480
    assert plan.line("optimizer").bytes == 2 * params
    # 128 micro-batches: the accumulator, and the LM head's gradient of the micro-batch under way
    # ([5,120 / 16, 151,936 / 4] float32)
    assert plan.line("gradients").bytes == params + 320 * 37_984 * 4
    # 512 x 16 rows / 128 micro-batches / 16 = 4 rows x 13,312 = 53,248 tokens; bf16; tensor 4 splits
    # heads 40 -> 10 (1,280 wide), KV 8 -> 2 (256), MLP 17,408 -> 4,352, vocab -> 37,984.
    kept = 40 * 53_248 * 5120 * 2                                          # remat full: each layer's input
    working = 53_248 * 2 * (3 * 5120 + 1280 + 2 * 256 + 1280 + 3 * 4352) * 2  # one layer, values + cotangents
    logits = 4 * 512 * 37_984 * 4                                          # one chunk of float32 logits
    assert plan.line("activations").bytes == kept + working + logits == 28_828_237_824
    # engine: bf16 over the host's 8 GPUs (5 heads, 1 KV head, 2,176 MLP, 18,992 vocab each)
    assert plan.line("engine weights").bytes == ((14_768_307_200 - 424_960) // 8 + 424_960) * 2
    # KV: 160 GiB / (256 positions x 40 layers x 2 x 8 heads x 128 x 2 bytes) = 4096 pages, 8 ways
    assert plan.line("KV pool").bytes == 4096 * 256 * 163_840 / 8 == 20 * GiB
    assert plan.overflow() is None and 57 * GiB < plan.total < 58 * GiB, plan.table()


def test_qwen3_0p6b_and_1p7b_on_one_gpu_hand_computed(tmp_path):
    cfg = _cfg(qwen3_0p6b_math, tmp_path, rl__token_budget=0, rl__micro_batches=32)  # padded rows
    small = memory_plan(shape("qwen3_0p6b"), cfg, devices=1, devices_per_process=1, capacity=76 * GiB)
    assert small.line("parameters").bytes == 596_049_920 * 4
    assert small.line("engine weights").bytes == 596_049_920 * 2  # bf16, whole (one device)
    # 16 GiB / (256 x 28 layers x 2 x 8 x 128 x 2 bytes) = 585 whole pages
    assert small.line("KV pool").bytes == 585 * 256 * 114_688
    # 32 x 8 rows / 32 micro-batches = 8 rows x 9,216 = 73,728 tokens, no tensor split
    tokens = 73_728
    act = 28 * tokens * 1024 * 2 + tokens * 2 * (3 * 1024 + 2048 + 2 * 1024 + 2048 + 3 * 3072) * 2 \
        + 8 * 512 * 151_936 * 4
    assert small.line("activations").bytes == act
    # 32 micro-batches: the accumulator + the tied LM head's gradient ([1,024, 151,936] float32)
    assert small.line("gradients").bytes == 596_049_920 * 4 + 1024 * 151_936 * 4
    assert small.overflow() is None, small.table()

    large = memory_plan(shape("qwen3_1p7b"), cfg, devices=1, devices_per_process=1, capacity=40 * GiB)
    assert large.line("parameters").bytes == 1_720_574_976 * 4
    assert large.line("optimizer").bytes == 2 * 1_720_574_976 * 4
    # parameters 6.4 + gradients 12.8 + optimizer 12.8 GiB = 32.0, then activations (21 GiB) pass 40
    assert large.overflow().name == "activations"
    assert "at 'activations'" in large.refusal() and "rl.micro_batches" in large.refusal()


def test_an_engine_on_devices_of_its_own_gets_its_own_lines_and_the_learner_the_rest(tmp_path):
    """rollout.jax.devices=4 of a host's 8 (issue 70): the learner's lines are those of a 4-device
    learner, the engine's those of an engine on 4 devices, and each device holds one side's, so the
    fullest side is what must fit; asking for every device is refused naming both numbers."""
    padded = dict(rl__token_budget=0, rl__micro_batches=32)
    shared = _cfg(qwen3_0p6b_math, tmp_path, **padded)
    own = _cfg(qwen3_0p6b_math, tmp_path, rollout__jax__devices=4, **padded)
    split = memory_plan(shape("qwen3_1p7b"), own, devices=8, devices_per_process=8, capacity=None)
    learner4 = memory_plan(shape("qwen3_1p7b"), shared, devices=4, devices_per_process=4, capacity=None)
    for name in ("parameters", "gradients", "optimizer", "activations", "engine weights", "KV pool"):
        assert split.line(name).bytes == learner4.line(name).bytes, name
    learner_side = sum(line.bytes for line in split.side(engine=False))
    engine_side = sum(line.bytes for line in split.side(engine=True))
    assert learner_side + engine_side == sum(line.bytes for line in split.lines)
    assert {line.name for line in split.side(engine=True)} == {"engine weights", "KV pool"}
    # the 16 GiB KV pool split 4 ways (the Pallas kernels too run by heads): the learner's side is fuller
    assert split.total == max(learner_side, engine_side) == learner_side
    assert "on each engine device:" in split.table()
    # a device between the two sides: the learner's side does not fit, the engine's does
    between = memory_plan(shape("qwen3_1p7b"), own, devices=8, devices_per_process=8,
                          capacity=(engine_side + learner_side) / 2)
    learner_names = {line.name for line in between.side(engine=False)}
    assert between.overflow().name in learner_names and f"at '{between.overflow().name}'" in between.refusal()
    assert sum(line.bytes for line in between.side(engine=True)) < between.capacity
    landed = memory_plan(shape("qwen3_1p7b"), _cfg(qwen3_0p6b_math, tmp_path, rollout__jax__devices=4,
                                                   rollout__jax__swap="landed"), devices=8, devices_per_process=8,
                         capacity=None)  # the in-flight swap's second buffer, on the engine's side
    assert landed.line("landing weights").bytes == landed.line("engine weights").bytes > 0
    assert "landing weights" in {line.name for line in landed.side(engine=True)}
    with pytest.raises(ValueError, match="rollout.jax.devices=8 leaves the learner 0 of each process's 8 devices"):
        memory_plan(shape("qwen3_1p7b"), _cfg(qwen3_0p6b_math, tmp_path, rollout__jax__devices=8), devices=8,
                    devices_per_process=8, capacity=None)


def test_unknown_device_memory_is_said_not_checked(tmp_path):
    plan = memory_plan(shape("qwen3_0p6b"), _cfg(qwen3_0p6b_math, tmp_path), devices=1, devices_per_process=1,
                       capacity=None)
    assert plan.overflow() is None and plan.refusal() is None
    assert "not checked" in plan.table()


@pytest.fixture
def qwen3_14b_dir(tmp_path):
    """config.json of Qwen3-14B alone: the plan reads the architecture, never the weights."""
    model_dir = tmp_path / "qwen3-14b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(shape("qwen3_14b").to_hf_dict()))
    return model_dir


def test_train_plan_prints_the_memory_per_device(tmp_path, qwen3_14b_dir):
    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train",
                           f"--config=experiments/rstar2_agent_14b.py:{qwen3_14b_dir},{data}",
                           f"--config.data.problems.eval_path={data}", f"--workdir={tmp_path / 'run'}", "--plan",
                           "--num_processes=8", "--config.mesh.device_memory_gb=76"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "learner mesh data 1 x fsdp 16 x tensor 4, engine over 8 device(s)" in proc.stdout
    assert "parameters           0.86" in proc.stdout and "KV pool             20.00" in proc.stdout, proc.stdout
    assert "packed rows of" in proc.stdout and "(rl.token_budget auto: the largest the memory plan fits)" in proc.stdout
    # the same job on 30 GiB devices: refused, naming the line that overflows
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train",
                           f"--config=experiments/rstar2_agent_14b.py:{qwen3_14b_dir},{data}",
                           f"--config.data.problems.eval_path={data}", f"--workdir={tmp_path / 'run'}", "--plan",
                           "--num_processes=8", "--config.mesh.device_memory_gb=30"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not fit a 30.0 GiB device: at 'KV pool'" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_auto_token_budget_is_the_largest_power_of_two_rows_the_plan_fits(tmp_path):
    """rl.token_budget=-1 (the default; issue 70 item 4): on an accelerator, packed rows at the
    largest max_len x 2^k whose plan fits (a step's kept tokens on one device at most); padded on
    the CPU or when rl.micro_batches > 1 asks for it; a number is kept."""
    from rstar2_jax.rl.memory_plan import auto_token_budget, resolve_token_budget

    cfg = _cfg(qwen3_0p6b_math, tmp_path)
    assert cfg.rl.token_budget == -1 and cfg.rl.micro_batches == 1
    longest = cfg.rollout.max_len
    budgets = {}
    for gib in (40, 76, 141):
        budget = auto_token_budget(shape("qwen3_0p6b"), cfg, devices=1, devices_per_process=1, capacity=gib * GiB)
        ratio = budget // longest
        assert budget % longest == 0 and ratio & (ratio - 1) == 0
        fits = memory_plan(shape("qwen3_0p6b"), dataclasses.replace(cfg, rl=dataclasses.replace(
            cfg.rl, token_budget=budget)), devices=1, devices_per_process=1, capacity=gib * GiB)
        larger = memory_plan(shape("qwen3_0p6b"), dataclasses.replace(cfg, rl=dataclasses.replace(
            cfg.rl, token_budget=2 * budget)), devices=1, devices_per_process=1, capacity=gib * GiB)
        assert fits.refusal() is None and (larger.refusal() or 2 * budget > 32 * 8 * longest), (gib, budget)
        budgets[gib] = budget
    assert budgets[40] <= budgets[76] <= budgets[141] and budgets[40] < budgets[141], budgets
    # what resolves it: the device, rl.micro_batches, an explicit number
    assert resolve_token_budget(cfg, 1, accelerator=False).rl.token_budget == 0
    two = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, micro_batches=2))
    assert resolve_token_budget(two, 1, accelerator=True).rl.token_budget == 0
    fixed = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, token_budget=16_384))
    assert resolve_token_budget(fixed, 1, accelerator=True) is fixed
    declared = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, device_memory_gb=76.0))
    assert resolve_token_budget(declared, 1).rl.token_budget > 0  # planned for a device from this CPU


def test_a_run_that_cannot_fit_is_refused_before_any_weight_is_loaded(tmp_path):
    work = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py",
                           f"--workdir={work}", "--config.mesh.device_memory_gb=0.01"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "memory plan: the run does not fit a 0.0 GiB device" in proc.stderr and "Traceback" not in proc.stderr
    assert not work.exists()  # no model built, no weight loaded, nothing written


def test_a_kl_reference_and_mini_batches_are_counted(tmp_path):
    """A KL term holds a float32 copy of the weights; mini-batches shrink the rows each step holds."""
    base = _cfg(qwen3_0p6b_math, tmp_path, rl__token_budget=0, rl__micro_batches=32)  # padded rows
    varied = RunConfig.from_mapping({**base.to_dict(), "rl": {**base.rl.to_dict(), "mini_batches": 2,
                                                               "kl": {"coef": 0.01, "estimator": "k3"}}})
    plain = memory_plan(shape("qwen3_0p6b"), base, devices=1, devices_per_process=1, capacity=76 * GiB)
    plan = memory_plan(shape("qwen3_0p6b"), varied, devices=1, devices_per_process=1, capacity=76 * GiB)
    assert plan.line("reference weights").bytes == 596_049_920 * 4
    assert "reference weights" not in [line.name for line in plain.lines]
    # 32 x 8 rows / 2 mini-batches / 32 micro-batches = 4 rows x 9,216 = 36,864 tokens
    tokens = 36_864
    act = 28 * tokens * 1024 * 2 + tokens * 2 * (3 * 1024 + 2048 + 2 * 1024 + 2048 + 3 * 3072) * 2 \
        + 4 * 512 * 151_936 * 4
    assert plan.line("activations").bytes == act


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_state_lines_are_what_xla_takes_as_the_update_s_arguments(micro_batches):
    """The plan's parameters and optimizer lines against XLA's own accounting of the compiled
    update (memory_analysis): its arguments are the parameters, the optimizer's moments and the
    batch, byte for byte (a missing moment, or bf16 master weights, fails here). The gradient and
    activation lines are calibrated against XLA:GPU (rl/memory_plan.py, BENCHMARKS.md): XLA:CPU
    keeps two gradient-sized trees at the peak where XLA:GPU keeps the LM head's alone, so a CPU
    check of them would test the CPU's scheduler, not the plan."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from experiments import tiny_arith
    from rstar2_jax.learner import Learner, LearnerSettings
    from rstar2_jax.models.decoder import Decoder
    from rstar2_jax.rl.memory_plan import architecture

    rows, seq = 4, 32
    c = tiny_arith.get_config()
    c.model.tiny_layers, c.model.tiny_hidden = 4, 512
    c.rl.batch_problems, c.rl.group_size, c.rl.micro_batches = rows // 2, 2, micro_batches
    c.rollout.max_len = seq
    c.stages = [{**stage, "max_response_tokens": seq // 2} for stage in c.stages]
    cfg, problems = RunConfig.parse(c.to_dict())
    assert not problems, problems
    arch = architecture(cfg)
    plan = memory_plan(arch, cfg, devices=1, devices_per_process=1, capacity=None)
    learner = Learner(Decoder(arch, dtype=jnp.float32, rngs=nnx.Rngs(0)),
                      LearnerSettings(micro_batches=micro_batches))
    batch = {"tokens": np.zeros((rows, seq), np.int32), "loss_mask": np.ones((rows, seq), np.float32),
             "advantages": np.ones((rows,), np.float32), "old_logprobs": np.zeros((rows, seq), np.float32)}
    compiled = learner._train.lower(learner.state, {k: jnp.asarray(v) for k, v in batch.items()}).compile()
    analysis = compiled.memory_analysis()
    state = plan.line("parameters").bytes + plan.line("optimizer").bytes
    # the optimizer's step counter (a few bytes) aside, exact
    assert abs(analysis.argument_size_in_bytes - sum(v.nbytes for v in batch.values()) - state) < 1024


def test_a_vllm_run_counts_what_its_weight_sync_holds(tmp_path):
    """Rollouts on vLLM servers: no engine weights or KV on the learner's devices, but what the
    weight sync holds: two tensors in the export dtype, split like the parameters (one trainer
    process) or whole (several: each is gathered)."""
    cfg = _cfg(qwen3_0p6b_math, tmp_path, rollout__engine="vllm", rollout__vllm__urls=("http://127.0.0.1:8100",),
               rollout__vllm__export_dtype="bfloat16", rollout__jax__page_size=0, rollout__jax__kv_memory_gb=0.0,
               rollout__jax__kv_pages=0)
    plan = memory_plan(shape("qwen3_0p6b"), cfg, devices=1, devices_per_process=1, capacity=76 * GiB)
    assert plan.line("engine weights").bytes == plan.line("KV pool").bytes == 0
    # Qwen3-0.6B ties its embeddings: the largest tensors are the embedding (151,936 x 1,024) and an
    # MLP projection (1,024 x 3,072), in bf16
    assert plan.line("weight sync").bytes == (151_936 * 1024 + 1024 * 3072) * 2
    # over 8 devices (FSDP) each holds an eighth of both (hidden splits 8 ways)
    split = memory_plan(shape("qwen3_0p6b"), cfg, devices=8, devices_per_process=8, capacity=76 * GiB)
    assert split.line("weight sync").bytes == (151_936 * 1024 + 1024 * 3072) * 2 / 8
    # 8 trainer processes: each tensor is gathered whole onto every device
    several = memory_plan(shape("qwen3_0p6b"), cfg, devices=8, devices_per_process=1, capacity=76 * GiB)
    assert several.line("weight sync").bytes == (151_936 * 1024 + 1024 * 3072) * 2
    assert "gathered over 8 processes" in several.line("weight sync").how


def test_an_nccl_sync_without_gpus_is_refused_at_plan_time(tmp_path):
    """rollout.vllm.sync=nccl broadcasts from the learner's GPUs: on a host without them, --plan
    (and a launch) refuses it, naming the sync methods that work, before anything starts."""
    args = [sys.executable, "-m", "rstar2_jax.train", "--config=experiments/tiny_arith.py",
            f"--workdir={tmp_path / 'run'}", "--config.rollout.engine=vllm",
            "--config.rollout.vllm.urls=http://127.0.0.1:1", "--config.rollout.vllm.sync=nccl"]
    for extra in (["--plan"], []):
        proc = subprocess.run(args + extra, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "rollout.vllm.sync=nccl" in proc.stderr and "rollout.vllm.sync=pull" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_packed_rows_count_one_row_of_the_token_budget_and_the_accumulator(tmp_path):
    """rl.token_budget: a micro-batch is one packed row of that many positions per device, and
    the micro-batches follow from the tokens (more than one: the accumulator is held)."""
    cfg = _cfg(qwen3_0p6b_math, tmp_path, rl__token_budget=16_384, rl__micro_batches=1)
    plan = memory_plan(shape("qwen3_0p6b"), cfg, devices=1, devices_per_process=1, capacity=76 * GiB)
    tokens = 16_384
    cudnn_packed_backward = 32 * 16 * tokens * 128 * 4  # rl.segments_per_row x q heads x budget x head_dim, f32
    act = 28 * tokens * 1024 * 2 + tokens * 2 * (3 * 1024 + 2048 + 2 * 1024 + 2048 + 3 * 3072) * 2 \
        + 1 * 512 * 151_936 * 4 + cudnn_packed_backward
    assert plan.line("activations").bytes == act and "1 packed row(s) x 16384" in plan.line("activations").how
    assert "packed backward 4.0 GiB at rl.segments_per_row=32" in plan.line("activations").how
    assert plan.line("gradients").bytes == 596_049_920 * 4 + 1024 * 151_936 * 4


def test_cudnn_s_packed_backward_is_counted_by_the_segment_bound(tmp_path):
    """cuDNN's packed attention holds [segment bound, heads, budget, head_dim] float32 in its
    backward (fitted on H200 peaks: BENCHMARKS.md, "Packed rows on an H200: MFU..."): the plan
    counts it from rl.segments_per_row, and not for XLA attention (no such buffer)."""
    def activations(**kw):
        cfg = _cfg(qwen3_0p6b_math, tmp_path, rl__token_budget=16_384, rl__micro_batches=1, **kw)
        return memory_plan(shape("qwen3_0p6b"), cfg, devices=1, devices_per_process=1, capacity=None).line(
            "activations").bytes
    wide, narrow, xla = activations(), activations(rl__segments_per_row=8), activations(model__attention="xla")
    assert wide - narrow == (32 - 8) * 16 * 16_384 * 128 * 4
    assert "packed backward" not in memory_plan(shape("qwen3_0p6b"), _cfg(
        qwen3_0p6b_math, tmp_path, rl__token_budget=16_384, rl__micro_batches=1, model__attention="xla"),
        devices=1, devices_per_process=1, capacity=None).line("activations").how
    assert xla > 0


def test_keeping_cudnn_s_attention_outputs_is_counted(tmp_path):
    """model.remat=dots_attention keeps, beyond "dots", each layer's attention output (q width, in
    the model's dtype) and cuDNN's softmax statistics (float32 per head and token, per segment
    slot of a packed row); with XLA attention it is "dots" (no cuDNN forward to keep)."""
    def activations(remat, attention="cudnn"):
        cfg = _cfg(qwen3_0p6b_math, tmp_path, rl__token_budget=16_384, rl__micro_batches=1, model__remat=remat,
                   model__attention=attention)
        return memory_plan(shape("qwen3_0p6b"), cfg, devices=1, devices_per_process=1, capacity=None).line(
            "activations")
    tokens, layers, heads, q_width = 16_384, 28, 16, 16 * 128
    statistics = layers * tokens * 32 * heads * 4
    assert activations("dots_attention").bytes - activations("dots").bytes == layers * tokens * q_width * 2 + statistics
    assert f"softmax statistics {statistics / GiB:.1f} GiB" in activations("dots_attention").how
    assert activations("dots_attention", "xla").bytes == activations("dots", "xla").bytes


def test_engine_replicas_each_hold_a_replicas_share_of_the_engines_devices(tmp_path):
    """rollout.jax.replicas (issue 70 item 2): each device holds one replica's share, so 2 replicas
    over 4 devices of its own plan the lines of one engine over 2 devices."""
    common = dict(rl__token_budget=0, rl__micro_batches=32, model__decode_attention="xla")
    replicated = _cfg(qwen3_0p6b_math, tmp_path, rollout__jax__devices=4, rollout__jax__replicas=2, **common)
    two = _cfg(qwen3_0p6b_math, tmp_path, rollout__jax__devices=2, **common)
    four = _cfg(qwen3_0p6b_math, tmp_path, rollout__jax__devices=4, **common)
    plans = [memory_plan(shape("qwen3_1p7b"), c, devices=8, devices_per_process=8, capacity=None)
             for c in (replicated, two, four)]
    for name in ("engine weights", "KV pool"):
        assert plans[0].line(name).bytes == plans[1].line(name).bytes > plans[2].line(name).bytes, name


def test_a_plan_on_a_login_node_from_a_public_shape_is_checked_against_a_named_device(tmp_path):
    """Issue 80 item 2: --plan needed model.path to be a directory, and with no device memory it
    printed 3,436 GiB of activations, "not checked". Now a shape by name, and an H100 unless told."""
    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    base = [sys.executable, "-m", "rstar2_jax.train", f"--config=experiments/rstar2_agent_14b.py:,{data}",
            f"--config.data.problems.eval_path={data}", f"--workdir={tmp_path / 'run'}", "--num_processes=8"]
    proc = subprocess.run(base + ["--plan", "--plan_model=Qwen/Qwen3-14B"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "planned for an H100 (76 GiB usable)" in proc.stdout and "device              76.00" in proc.stdout
    assert "not checked" not in proc.stdout and "14.77B parameters" in proc.stdout
    proc = subprocess.run(base + ["--plan", "--plan_model=qwen3_14b", "--config.mesh.device_kind=h200"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "device             132.00" in proc.stdout and "H100" not in proc.stdout, proc.stdout
    proc = subprocess.run(base + ["--plan_model=qwen3_14b"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--plan_model is for --plan" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()
