"""One jitted program per process for equal static parts (rstar2_jax/shared_jit.py): a second
learner, SFT trainer or engine over the same graph and settings traces nothing again, and one
with other settings never gets the first one's program."""

import asyncio

import numpy as np

from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.learner.optimizer import make_optimizer
from rstar2_jax.learner.sft import SFTTrainer
from rstar2_jax.rollout.engines.jax_engine import JaxEngine
from rstar2_jax.rollout.sampling import SamplingParams
from rstar2_jax.shared_jit import shared_jit
from tests.models.conftest import random_model, small_config


def _scaled(x, *, by):
    return x * by


def test_equal_static_parts_give_the_one_program_and_others_their_own():
    first = shared_jit(_scaled, by=2.0, donate_argnums=())
    assert shared_jit(_scaled, by=2.0) is first
    assert shared_jit(_scaled, by=3.0) is not first
    assert shared_jit(_scaled, by=2.0, donate_argnums=(0,)) is not first
    assert float(first(np.float32(4.0))) == 8.0 and float(shared_jit(_scaled, by=3.0)(np.float32(4.0))) == 12.0


def test_equal_optimizer_settings_give_the_same_transformation():
    kw = dict(lr=1e-3, warmup_steps=2, weight_decay=0.0, grad_clip=1.0)
    assert make_optimizer(**kw) is make_optimizer(**kw)
    assert make_optimizer(**kw) is not make_optimizer(**{**kw, "lr": 2e-3})


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = [list(rng.integers(1, 257, size=int(rng.integers(10, 40)))) for _ in range(4)]
    return make_batch(tokens, [[0] * 5 + [1] * (len(t) - 5) for t in tokens], [[0.0] * len(t) for t in tokens],
                      list(rng.normal(size=4)), pad_multiple=16)


def test_a_second_learner_like_the_first_traces_nothing_and_updates_alike():
    cfg = small_config("qwen3")
    settings = LearnerSettings(lr=1e-3)
    first, second = (Learner(random_model(cfg, seed=1), settings) for _ in range(2))
    assert second._train is first._train and second._logprobs is first._logprobs
    metrics = first.update(_batch())
    traced = first._train._cache_size()
    assert metrics == second.update(_batch())  # the same program on the same weights and batch
    assert second._train._cache_size() == traced  # nothing new compiled for the second learner
    other = Learner(random_model(cfg, seed=1), LearnerSettings(lr=2e-3))
    assert other._train is not first._train  # other settings: their own program
    assert other.update(_batch())["grad_norm"] == metrics["grad_norm"]


def test_sft_trainers_share_their_step_per_settings():
    cfg = small_config("qwen3")
    a, b = (SFTTrainer(random_model(cfg, seed=0), lr=1e-3, warmup_steps=1) for _ in range(2))
    assert a._step is b._step
    assert SFTTrainer(random_model(cfg, seed=0), lr=2e-3, warmup_steps=1)._step is not a._step


def test_engines_over_one_model_share_their_kernels(tiny_model, tokenizer):
    async def first_token():
        async with JaxEngine(tiny_model, tokenizer, slots=2, max_len=64) as eng:
            out = await eng.generate(tokenizer.encode("1+1="), SamplingParams(max_tokens=4, temperature=0.0))
            return eng.kernels, out.token_ids

    (k1, t1), (k2, t2) = (asyncio.run(first_token()) for _ in range(2))
    assert k1 is k2 and t1 == t2
    compiled = k1.decode._cache_size()
    asyncio.run(first_token())
    assert k1.decode._cache_size() == compiled  # the second engine's decode was the first's program
