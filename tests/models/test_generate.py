"""KV-cached sampling agrees with full forwards of the generated sequence."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar2_jax.models.generate import generate
from tests.models.conftest import random_model, small_config


def test_greedy_generation_and_logprobs_match_full_forward():
    model = random_model(small_config("qwen3"), seed=11)
    prompts = [[5, 9, 13, 200, 7], [42, 3]]
    out = generate(model, prompts, max_new_tokens=12, temperature=0.0, eos_ids=())
    forward = nnx.jit(lambda m, t: m(t))
    for prompt, ids, logps in zip(prompts, out.token_ids, out.logprobs):
        assert len(ids) == 12
        seq = jnp.asarray([prompt + ids], jnp.int32)
        logp = np.asarray(jax.nn.log_softmax(forward(model, seq)[0], axis=-1))
        for j, tok in enumerate(ids):
            row = logp[len(prompt) - 1 + j]
            assert tok == int(row.argmax())
            np.testing.assert_allclose(logps[j], row[tok], atol=1e-4)


def test_sampling_stops_at_eos_and_reports_tempered_logprobs():
    model = random_model(small_config("qwen3", vocab_size=8), seed=2)
    out = generate(model, [[1, 2, 3]] * 4, max_new_tokens=30, temperature=0.7, seed=1, eos_ids=(0,))
    forward = nnx.jit(lambda m, t: m(t))
    for ids, logps in zip(out.token_ids, out.logprobs):
        assert 0 not in ids[:-1]
        assert len(ids) == 30 or ids[-1] == 0
        seq = jnp.asarray([[1, 2, 3] + ids], jnp.int32)
        logp = np.asarray(jax.nn.log_softmax(forward(model, seq)[0] / 0.7, axis=-1))
        want = [logp[2 + j, t] for j, t in enumerate(ids)]
        np.testing.assert_allclose(logps, want, atol=1e-4)
    assert any(len(ids) < 30 for ids in out.token_ids)  # 8-token vocab: EOS comes quickly
