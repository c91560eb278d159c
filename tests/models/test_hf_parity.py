"""Our decoder against transformers (torch CPU) on random tiny configs of each family."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from rstar2_jax import models
from tests.models import hf_reference as ref

LENGTHS = [520, 300, 37]  # >= 512 tokens, and right padding in the same batch
TOL = 1e-4


def _valid(logits, lengths):
    return np.concatenate([logits[i, :n] for i, n in enumerate(lengths)])


@pytest.mark.parametrize("family", sorted(ref.FAMILIES))
def test_loads_transformers_checkpoint_and_matches_logits(family, tmp_path):
    hf_model = ref.build_hf_model(family)
    hf_model.save_pretrained(tmp_path)
    model = models.load_pretrained(tmp_path, dtype=jnp.float32)

    tokens = ref.right_padded_batch(hf_model.config.vocab_size, LENGTHS)
    ours = np.asarray(model(jnp.asarray(tokens)))
    theirs = ref.hf_logits(hf_model, tokens, np.array(LENGTHS))
    diff = np.abs(_valid(ours, LENGTHS) - _valid(theirs, LENGTHS)).max()
    assert diff <= TOL, f"{family}: max |logit diff| {diff:.2e} > {TOL}"


@pytest.mark.parametrize("family", ["qwen3_tied", "qwen2_bias", "llama3_rope_scaling"])
def test_transformers_loads_our_saved_directory(family, tmp_path):
    hf_model = ref.build_hf_model(family, seed=1)
    hf_model.save_pretrained(tmp_path / "src")
    model = models.load_pretrained(tmp_path / "src")
    models.save_pretrained(model, tmp_path / "ours")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="float32")
    reloaded.config._attn_implementation = "eager"
    tokens = ref.right_padded_batch(hf_model.config.vocab_size, [64, 40], seed=2)
    ours = np.asarray(model(jnp.asarray(tokens)))
    theirs = ref.hf_logits(reloaded.eval(), tokens, np.array([64, 40]))
    diff = np.abs(_valid(ours, [64, 40]) - _valid(theirs, [64, 40])).max()
    assert diff <= TOL, f"{family}: transformers on our directory differs by {diff:.2e}"
