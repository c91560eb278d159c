"""One jitted program per process for equal static parts (rstar2_jax/core/shared_jit.py): a second
learner, SFT trainer or engine over the same graph and settings traces nothing again, and one
with other settings never gets the first one's program."""

import asyncio

import numpy as np

from rstar2_jax.learner import Learner, LearnerSettings, make_batch
from rstar2_jax.learner.optimizer import make_optimizer
from rstar2_jax.learner.sft import SFTTrainer
from rstar2_jax.rollout.engines.jax_engine.engine import JaxEngine
from rstar2_jax.rollout.engines.sampling import SamplingParams
from rstar2_jax.core.shared_jit import shared_jit
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


def test_a_second_copy_of_the_weights_for_the_engine_traces_nothing():
    """processes.local_copy (each sync of an engine that keeps a copy) and sharding.gathered (each
    gather over processes) reuse one program per tensor shape and target. A fresh
    `jax.jit(lambda ...)` per call traced every tensor again at every sync: 1.4 s of each 1.5 s
    sync of a two-process tiny run (BENCHMARKS.md, "Test suite")."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from rstar2_jax.core import processes
    from rstar2_jax.core import sharding

    params = nnx.state(random_model(small_config("qwen3"), seed=0), nnx.Param)
    processes.local_copy(params)
    traces = []

    def count(event, _duration, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traces.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        copy = processes.local_copy(params)
        assert not traces  # every tensor shape was traced by the first copy
        first = jax.tree.leaves(copy)[0]
        mesh = Mesh(jax.devices()[:1], ("x",))
        sharding.resharder(NamedSharding(mesh, PartitionSpec()))(first)
        assert len(traces) == 1  # a new target: its program, once
        sharding.resharder(NamedSharding(mesh, PartitionSpec()))(first)
        assert len(traces) == 1  # an equal target: the same program
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
        assert np.array_equal(a, b) and a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()  # a copy
