"""A LoRA run end to end on the embedded engine: SFT and RL train only the adapters, the engine
samples with them (no second base), checkpoints hold the adapters alone and resume exactly, and
the run exports as a PEFT adapter or a merged HF model that load back to the same policy."""

import asyncio
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar2_jax import models
from rstar2_jax.core.checkpoints import load_run_policy
from rstar2_jax.models import lora
from rstar2_jax.rl.engine_weights import engine_weights
from rstar2_jax.models.adapter_files import is_adapter_dir, load_model_dir
from rstar2_jax.rl.trainer import RLRun
from tests.rl.test_async import moving_advantage, moving_config  # noqa: F401 (a fixture)
from tests.rl.test_training import COMPARED, ROOT, close_to_rounding, rl_lines

pytestmark = [pytest.mark.usefixtures("moving_advantage")]


def lora_config(steps):
    c = moving_config(steps, max_staleness=0)  # updates that move the weights, whatever the rewards
    c.model.lora.rank, c.model.lora.alpha = 4, 8.0
    c.model.lora.targets = ("q_proj", "v_proj", "down_proj")
    c.rl.kl.coef, c.rl.kl.place = 0.05, "loss"  # the reference: the adapters after SFT
    c.rl.lr = 1e-2
    return c


def test_a_lora_run_trains_the_adapters_resumes_exactly_and_exports(tmp_path):
    straight = RLRun(lora_config(3), str(tmp_path / "straight"))
    asyncio.run(straight.run())
    asyncio.run(RLRun(lora_config(2), str(tmp_path / "resumed")).run())
    resumed = RLRun(lora_config(3), str(tmp_path / "resumed"))
    asyncio.run(resumed.run())
    a, b = rl_lines(tmp_path / "straight"), rl_lines(tmp_path / "resumed")
    assert [l["step"] for l in b] == [0, 1, 2] and all("optimizer_steps" in l for l in a)
    for la, lb in zip(a, b):
        for key in COMPARED:
            if key in la:
                assert close_to_rounding(la[key], lb[key], key), (la["step"], key)
        # the engine sampled with the adapters the learner had (sharing its base): float32, on-policy
        assert la["logprob_mismatch_max"] < 1e-4

    learner = straight.learner
    base = models.load_pretrained(straight.model_dir)
    loaded = dict(nnx.to_flat_state(nnx.state(base, nnx.Param)))
    for path, var in nnx.to_flat_state(learner.frozen):  # the base never moved
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(loaded[path].get_value()))
    assert {p[-2] for p, _ in nnx.to_flat_state(learner.state.params)} == {"q_proj_lora", "v_proj_lora",
                                                                           "down_proj_lora"}
    # the engine holds the learner's base, not a copy: on-policy float32 (the whole state shared), and
    # an engine in the compute dtype (bf16 runs: the base is loaded in it) copies the adapters only
    base_ids = {id(x) for x in jax.tree.leaves(learner.frozen)}
    assert base_ids <= {id(x) for x in jax.tree.leaves(engine_weights(learner, straight.cfg, 1))}
    straight.cfg = dataclasses.replace(straight.cfg, model=dataclasses.replace(straight.cfg.model, dtype="bfloat16"))
    held = engine_weights(learner, straight.cfg, 1)
    assert base_ids <= {id(x) for x in jax.tree.leaves(held)}
    adapters = [x for p, x in nnx.to_flat_state(held) if str(p[-2:][0]).endswith(lora.ADAPTER_SUFFIX)]
    assert adapters and {x.get_value().dtype for x in adapters} == {jnp.dtype(jnp.bfloat16)}
    tokens = jnp.asarray([list(range(5, 29))], jnp.int32)
    policy = learner.model()(tokens)
    assert float(jnp.abs(policy - base(tokens)).max()) > 1e-3  # the adapters changed the policy
    np.testing.assert_allclose(np.asarray(load_run_policy(str(tmp_path / "straight"))(tokens)), np.asarray(policy),
                               atol=1e-5)

    for flag, out in (("", "adapter"), ("--merged", "merged")):
        proc = subprocess.run([sys.executable, "-m", "rstar2_jax.export", f"--checkpoint={tmp_path / 'straight'}",
                               f"--out={tmp_path / out}", *([flag] if flag else [])],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert is_adapter_dir(str(tmp_path / "adapter")) and not is_adapter_dir(str(tmp_path / "merged"))
    assert os.path.getsize(tmp_path / "adapter" / "adapter_model.safetensors") < 0.2 * os.path.getsize(
        os.path.join(straight.model_dir, "model.safetensors"))
    for exported in ("adapter", "merged"):  # what evaluate and chat load as --model
        loaded = load_model_dir(str(tmp_path / exported))
        assert lora.has_adapters(loaded) == (exported == "adapter")
        np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(policy), atol=1e-4)
    # adapter-only checkpoints: the state holds the adapters and their moments, not the base
    state_bytes = checkpoint_state_bytes(tmp_path / "straight", 3)
    base_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(learner.frozen))
    assert state_bytes < 0.5 * base_bytes


def checkpoint_state_bytes(run_dir, step: int) -> int:
    """The bytes of a run's checkpointed train state at `step` (with LoRA: adapters and moments only)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
               os.walk(os.path.join(run_dir, "checkpoints", str(step), "state")) for f in fs)
