"""LoRA adapters (models/lora.py, models/adapter_files.py): the published forward, PEFT's files,
what the learner trains, and the config errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from rstar2_jax import models
from rstar2_jax.algo import KLConfig
from rstar2_jax.core.checkpoints import BaseMismatch, RunCheckpoints
from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.learner.sft import SFTTrainer
from rstar2_jax.models import lora, tiny
from rstar2_jax.models.adapter_files import (CONFIG_FILE, WEIGHTS_FILE, base_identity, load_adapter,
                                             read_adapter_config, write_adapter)
from rstar2_jax.models.resolve import PolicyModelConfig, load_policy

TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 300, (2, 12)), jnp.int32)


RANK4 = lora.LoRAConfig(rank=4, alpha=8.0)


def adapted(tiny_dir, cfg=RANK4, seed=1, noise=0.05):
    """The tiny model with adapters set to random values (B nonzero: they change the output)."""
    model = lora.attach(models.load_pretrained(tiny_dir), cfg, seed=seed)
    state = nnx.state(model, lora.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + noise * jax.random.normal(next(keys), x.shape), state))
    return model


def test_fresh_adapters_leave_the_model_unchanged_and_trained_ones_change_it(tiny_dir, tiny_model):
    base = tiny_model(TOKENS)
    fresh = lora.attach(models.load_pretrained(tiny_dir), lora.LoRAConfig(rank=4), seed=0)
    assert jnp.array_equal(fresh(TOKENS), base)  # B starts at zero (Hu et al. 2021, section 4.1)
    assert float(jnp.abs(adapted(tiny_dir)(TOKENS) - base).max()) > 1e-2


def test_a_projection_computes_hf_linear_plus_scaled_peft_product(tiny_dir):
    """The published LoRA forward, h = W0 x + (alpha / r) B A x (Hu et al. 2021, eq. 3; PEFT's
    `lora.Linear.forward`: result + lora_B(lora_A(x)) * scaling, scaling = lora_alpha / r), computed
    in numpy from the HF checkpoint's q_proj / o_proj weights and the PEFT files we write, against
    our attention's projections."""
    from safetensors.numpy import load_file as load_hf
    cfg = lora.LoRAConfig(rank=4, alpha=12.0, targets=("q_proj", "o_proj"))
    model = adapted(tiny_dir, cfg)
    out = write_adapter(nnx.state(model, nnx.Param), cfg, os.path.join(tiny_dir, "..", "peft_forward"))
    peft, hf = load_file(os.path.join(out, WEIGHTS_FILE)), load_hf(os.path.join(tiny_dir, "model.safetensors"))
    attn = model.layers[0].attn
    x = np.random.default_rng(1).normal(size=(1, 3, model.cfg.hidden_size)).astype(np.float32)
    pre = "base_model.model.model.layers.0.self_attn."
    for name, ours, width_in in (("q_proj", lambda v: attn._project(jnp.asarray(v), "q_proj", "q_bias"), None),
                                 ("o_proj", None, model.cfg.num_heads * model.cfg.head_dim)):
        w = hf[f"model.layers.0.self_attn.{name}.weight"]  # [out, in]
        a, b = peft[pre + f"{name}.lora_A.weight"], peft[pre + f"{name}.lora_B.weight"]  # [r, in], [out, r]
        v = x if width_in is None else np.random.default_rng(2).normal(size=(1, 3, width_in)).astype(np.float32)
        expected = v @ w.T + (cfg.alpha / cfg.rank) * (v @ a.T) @ b.T
        if name == "q_proj":
            got = np.asarray(ours(v)).reshape(expected.shape)
        else:
            heads = jnp.asarray(v.reshape(1, 3, model.cfg.num_heads, model.cfg.head_dim))
            got = np.asarray(lora.adapted(attn, "o_proj", heads,
                                          jnp.einsum("bthd,hde->bte", heads, attn.o_proj[...])))
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


@settings(max_examples=4, deadline=None)
@given(rank=st.sampled_from([1, 2, 8]), targets=st.sets(st.sampled_from(tuple(lora.TARGETS)), min_size=1))
def test_peft_files_round_trip_and_carry_peft_names_and_shapes(tiny_dir, tmp_path_factory, rank, targets):
    cfg = lora.LoRAConfig(rank=rank, alpha=2.0 * rank, targets=tuple(t for t in lora.TARGETS if t in targets))
    model = adapted(tiny_dir, cfg)
    out = write_adapter(nnx.state(model, nnx.Param), cfg, str(tmp_path_factory.mktemp("peft")), base_model=tiny_dir)
    tensors = load_file(os.path.join(out, WEIGHTS_FILE))
    c = model.cfg
    width = {"q_proj": (c.hidden_size, c.num_heads * c.head_dim), "o_proj": (c.num_heads * c.head_dim, c.hidden_size),
             "k_proj": (c.hidden_size, c.num_kv_heads * c.head_dim), "v_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
             "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
             "down_proj": (c.intermediate_size, c.hidden_size)}
    assert len(tensors) == 2 * c.num_layers * len(cfg.targets)
    for t in cfg.targets:
        part = lora.TARGETS[t][1]
        assert tensors[f"base_model.model.model.layers.1.{part}.lora_A.weight"].shape == (rank, width[t][0])
        assert tensors[f"base_model.model.model.layers.1.{part}.lora_B.weight"].shape == (width[t][1], rank)
    with open(os.path.join(out, CONFIG_FILE)) as f:
        assert json.load(f)["base_model_name_or_path"] == tiny_dir
    assert read_adapter_config(out) == cfg
    loaded = load_adapter(lora.attach(models.load_pretrained(tiny_dir), cfg, seed=99), out)
    np.testing.assert_array_equal(np.asarray(loaded(TOKENS)), np.asarray(model(TOKENS)))
    assert lora.config_of(loaded) == cfg


def test_the_learner_trains_only_the_adapters_and_its_reference_is_their_start(tiny_dir):
    model = adapted(tiny_dir)
    start = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    learner = Learner(model, LearnerSettings(lr=1e-2, warmup_steps=1, kl=KLConfig(coef=0.1, place="loss")))
    assert len(jax.tree.leaves(learner.state.params)) == 2 * 7 * model.cfg.num_layers  # the adapters alone
    assert len(jax.tree.leaves(learner.state.opt_state)) < 4 * len(jax.tree.leaves(learner.frozen))
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(1, 300, 12)) for _ in range(4)]
    metrics = learner.update(make_batch(ids, [[0] * 4 + [1] * 8] * 4, [[0.0] * 12] * 4, [1.0, -1.0, 0.5, -0.5],
                                        pad_multiple=16))
    assert metrics["grad_norm"] > 0
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(learner.model_state())}
    moved = {k for k in start if not np.array_equal(start[k], after[k])}
    assert moved and all(isinstance(k[-1], str) and k[-2].endswith(lora.ADAPTER_SUFFIX) for k in moved)
    assert {k for k in moved if k[-1] == "b"}  # B moved off zero: the adapters now change the output
    ref = {k: np.asarray(v) for k, v in nnx.to_flat_state(learner.ref_params)}
    assert all(np.array_equal(ref[k], start[k]) for k in ref)  # the reference: adapters as they started


def test_sft_trains_the_adapters_and_hands_back_the_whole_model(tiny_dir, tokenizer):
    model = lora.attach(models.load_pretrained(tiny_dir), lora.LoRAConfig(rank=2), seed=0)
    trainer = SFTTrainer(model, lr=1e-2, warmup_steps=1, pad_multiple=16)
    ids = list(tokenizer.encode("1+1=2"))
    first = trainer.step([(ids, [1] * len(ids))] * 2)["loss"]
    for _ in range(3):
        last = trainer.step([(ids, [1] * len(ids))] * 2)["loss"]
    assert last < first
    whole = trainer.params()
    assert len(jax.tree.leaves(whole)) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_bad_lora_settings_are_config_errors_naming_the_fix(tiny_dir, tmp_path):
    _, problems = PolicyModelConfig.parse({"lora": {"rank": 4, "targets": ["q_proj", "qkv"]}}, "model")
    assert any("model.lora.targets" in str(p) and "qkv" in str(p) for p in problems)
    # settings of LoRA while it is off are refused like any unselected part's (issue 69), all at once
    _, problems = PolicyModelConfig.parse({"lora": {"dropout": 0.1, "targets": ["q_proj"]}}, "model")
    assert sorted(str(p).split(":")[0] for p in problems) == ["model.lora.dropout", "model.lora.targets"]
    assert all("LoRA is off (model.lora.rank=0)" in str(p) for p in problems)
    too_wide = PolicyModelConfig(lora=lora.LoRAConfig(rank=65, targets=("k_proj",)))  # k_proj: 128 -> 64
    with pytest.raises(ConfigValueError, match=r"model.lora.rank: rank 65 is above k_proj's width 64"):
        load_policy(too_wide, tiny_dir, seed=0)
    from rstar2_jax.rl.config import base_config, validate
    c = base_config()
    c.model.lora.rank = 4
    c.rollout.engine = "vllm"
    c.rollout.vllm.urls = ("http://127.0.0.1:1",)
    c.rollout.vllm.sync = "nccl"
    with pytest.raises(ConfigValueError, match=r"model.lora.rank: LoRA adapters reach vLLM servers by files or pull, not .*nccl"):
        validate(c, 1)


def test_policy_loading_freezes_the_base_in_the_compute_dtype(tiny_dir):
    model = load_policy(PolicyModelConfig(dtype="bfloat16", lora=lora.LoRAConfig(rank=2)), tiny_dir, seed=0)
    _, trained, frozen = lora.split_trained(model)
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(trained)} == {jnp.dtype(jnp.float32)}
    full = load_policy(PolicyModelConfig(dtype="bfloat16"), tiny_dir, seed=0)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(full, nnx.Param))} == {jnp.dtype(jnp.float32)}


def test_an_adapter_checkpoint_refuses_another_base(tiny_dir, tmp_path):
    other = tiny.build_tiny_model(tmp_path / "other_base", seed=7)
    model = lora.attach(models.load_pretrained(tiny_dir), lora.LoRAConfig(rank=2), seed=0)
    learner = Learner(model, LearnerSettings())
    saved = RunCheckpoints(str(tmp_path / "ck"), base=base_identity(tiny_dir))
    saved.save(1, learner.state, {"x": 1})
    saved.close()
    assert base_identity(tiny_dir) != base_identity(other)
    for base, match in ((base_identity(other), "another base model"), (None, "holds LoRA adapters")):
        ck = RunCheckpoints(str(tmp_path / "ck"), base=base)
        with pytest.raises(BaseMismatch, match=match):
            ck.restore(1, learner.state)
        ck.close()
    ck = RunCheckpoints(str(tmp_path / "ck"), base=base_identity(tiny_dir))
    restored, meta = ck.restore(1, learner.state)
    ck.close()
    assert meta == {"x": 1} and len(jax.tree.leaves(restored.params)) == len(jax.tree.leaves(learner.state.params))


def test_the_plan_counts_the_frozen_base_and_float32_adapters():
    """Qwen3-14B at rank 32 on 8 devices, by hand: the adapters hold 40 layers x 32 x (in + out)
    summed over q (5120+5120), k and v (5120+1024 each), o (5120+5120), gate, up, down
    (5120+17408 each) = 128,450,560 numbers; the base's bf16 shard is half its float32 one."""
    from rstar2_jax.models.config import ModelConfig
    from rstar2_jax.models.shard_sizes import shard_bytes
    from rstar2_jax.rl.config import base_config, validate
    from rstar2_jax.rl.memory_plan import memory_plan
    arch = ModelConfig(family="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=40,
                       num_heads=40, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       qk_norm=True, max_position_embeddings=40960)
    n = 40 * 32 * (2 * 10240 + 2 * 6144 + 3 * 22528)
    assert n == 128_450_560 == lora.adapter_parameters(lora.LoRAConfig(rank=32), arch)
    c = base_config()
    c.model.dtype, c.model.lora.rank, c.rl.kl.coef = "bfloat16", 32, 0.01
    plan = memory_plan(arch, validate(c, 1), devices=8, devices_per_process=8, capacity=None)
    mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    assert plan.line("parameters").bytes == shard_bytes(arch, mesh, 2) + 4 * n
    assert (plan.line("gradients").bytes, plan.line("optimizer").bytes) == (4 * n, 8 * n)
    assert plan.line("reference weights").bytes == 4 * n


def test_the_adapter_count_is_what_attach_creates(tiny_dir):
    model = models.load_pretrained(tiny_dir)
    for cfg in (lora.LoRAConfig(rank=3), lora.LoRAConfig(rank=5, targets=("o_proj", "up_proj"))):
        attached = lora.attach(models.load_pretrained(tiny_dir), cfg, seed=0)
        held = sum(x.size for x in jax.tree.leaves(nnx.state(attached, lora.LoRAParam)))
        assert held == lora.adapter_parameters(cfg, model.cfg)


def test_dropout_drops_adapter_inputs_in_gradient_passes_only_and_keeps_their_mean(tiny_dir):
    """Inverted dropout on the adapter's input (PEFT's lora_dropout: lora_B(lora_A(dropout(x))),
    each kept input scaled by 1 / (1 - p)): its mean over keys is the undropped output."""
    adapter = lora.Adapter((16, 8), ("embed", "mlp"), 1, 4, 2.0, rngs=nnx.Rngs(0), dropout=0.25)
    adapter.b.set_value(jnp.ones((4, 8)))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16)), jnp.float32)
    plain = adapter(x)
    with lora.dropout_key(jax.random.key(1)):
        once = adapter(x)
    assert not jnp.allclose(once, plain)
    # 2000 keys in one compiled pass (key by key, eagerly, took 40 s of the suite)
    graphdef, state = nnx.split(adapter)
    dropped = jax.jit(jax.vmap(lambda k: _dropped(nnx.merge(graphdef, state), x, k)))
    mean = jnp.mean(dropped(jax.random.split(jax.random.key(2), 2000)), axis=0)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(plain), atol=0.1 * float(jnp.abs(plain).max()))

    cfg = lora.LoRAConfig(rank=4, alpha=8.0, dropout=0.5)
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(1, 300, 12)) for _ in range(4)]
    batch = make_batch(ids, [[0] * 4 + [1] * 8] * 4, [[0.0] * 12] * 4, [1.0, -1.0, 0.5, -0.5], pad_multiple=16)
    norms, logprobs = {}, {}
    for p in (0.0, 0.5):
        learner = Learner(adapted(tiny_dir, lora.LoRAConfig(rank=4, alpha=8.0, dropout=p)), LearnerSettings(lr=0.0))
        logprobs[p] = learner.logprobs(batch.tokens)
        norms[p] = learner.update(batch)["grad_norm"]
        np.testing.assert_array_equal(learner.logprobs(batch.tokens), logprobs[p])  # lr 0: nothing moved
    np.testing.assert_allclose(logprobs[0.5], logprobs[0.0], atol=1e-6)  # log-prob passes run undropped
    assert norms[0.5] != pytest.approx(norms[0.0], rel=1e-4)  # the gradient pass dropped inputs
    assert lora.config_of(adapted(tiny_dir, cfg)) == cfg


def _dropped(adapter, x, key):
    with lora.dropout_key(key):
        return adapter(x)
