"""One pass (rl.old_logprobs): where one optimizer step is the whole update, the old log-probs
are the update's own forward pass (stop-gradient), and that update equals the one with a
separate old-log-prob pass: the step (every gradient leaf), every metric, the log-probs and
entropies it hands back, for every loss, aggregation and correction, on padded and packed rows
(float32 CPU). Where it is not exact the separate pass runs, or a request for one pass is refused."""

import jax
import numpy as np
import optax
import pytest

from rstar2_jax.algo import KLConfig, PolicyLossConfig
from rstar2_jax.algo.corrections import CORRECTIONS, CorrectionConfig
from rstar2_jax.algo.corrections.importance import CapSettings
from rstar2_jax.algo.corrections.masks import BandSettings, GeoBandSettings
from rstar2_jax.algo.aggregation import AGGREGATIONS
from rstar2_jax.algo.losses import LOSSES
from rstar2_jax.learner import Learner, LearnerSettings
from tests.learner.test_learner import _batch
from tests.models.conftest import random_model, small_config

# Each cell a loss, an aggregation and corrections (composed: each masks or clips some tokens,
# not all, with the sampler below); together they cover every registered loss, aggregation and
# correction (checked below).
CELLS = {
    "clip_higher,token_mean,token_tis+geo_mask": dict(
        loss=PolicyLossConfig(name="clip_higher", aggregation="token_mean"),
        correction=CorrectionConfig(names=("token_tis", "geo_mask"), token_tis=CapSettings(cap=1.1),
                                    geo_mask=GeoBandSettings(low=0.97, high=1.03))),
    "cispo,seq_mean_token_mean,seq_tis+icepop": dict(
        loss=PolicyLossConfig(name="cispo", aggregation="seq_mean_token_mean"),
        correction=CorrectionConfig(names=("seq_tis", "icepop"), seq_tis=CapSettings(cap=1.5),
                                    icepop=BandSettings(low=0.9, high=1.1))),
    "gspo,seq_mean_token_mean,seq_mis+decoupled_ppo": dict(
        loss=PolicyLossConfig(name="gspo"),
        correction=CorrectionConfig(names=("seq_mis", "decoupled_ppo"), seq_mis=CapSettings(cap=1.2))),
    "reinforce,seq_mean_token_sum,token_mis": dict(
        loss=PolicyLossConfig(name="reinforce", aggregation="seq_mean_token_sum"),
        correction=CorrectionConfig(names=("token_mis",), token_mis=CapSettings(cap=1.1))),
    "clip_higher,constant,none": dict(loss=PolicyLossConfig(aggregation="constant", constant_tokens=48)),
}


def test_the_cells_cover_every_loss_aggregation_and_correction():
    losses = {c["loss"].name for c in CELLS.values()}
    aggregations = {c["loss"].aggregation_name() for c in CELLS.values()}
    corrections = {n for c in CELLS.values() if "correction" in c for n in c["correction"].names}
    assert losses == set(LOSSES) and aggregations == set(AGGREGATIONS) and corrections == set(CORRECTIONS)


def _sampler_logprobs(learner, batch, seed=0):
    """A sampler off the learner by a per-sequence shift and per-token noise, so that sequence-
    and token-level corrections each bind on some sequences and tokens, not all."""
    rng = np.random.default_rng(seed)
    lp = learner.logprobs(batch.tokens)
    shift = rng.normal(0, 0.04, (lp.shape[0], 1)) + rng.normal(0, 0.06, lp.shape)
    return np.where(batch.loss_mask > 0, lp + shift, 0.0).astype(np.float32)


def _update(source: str, budget: int, micro_batches: int = 1, **kw):
    """One update (SGD, lr 1: the step is the gradient) with rl.old_logprobs=`source`: (step per
    leaf, metrics, batch as the update left it)."""
    learner = Learner(random_model(small_config("qwen3"), seed=1),
                      LearnerSettings(token_budget=budget, micro_batches=micro_batches, old_logprobs=source, **kw),
                      optimizer=optax.sgd(1.0))
    batch = _batch(rows=8, length=40)
    batch.sampler_logprobs = _sampler_logprobs(learner, batch)
    start = [np.asarray(x) for x in jax.tree.leaves(learner.state.params)]
    metrics = learner.update(batch)
    step = [np.asarray(x) - s for x, s in zip(jax.tree.leaves(learner.state.params), start)]
    return step, metrics, batch


# The separate pass and the update's forward pass compute the same log-probs in other orders
# (another program): they differ by float32 rounding, ~1e-7 here (a ratio of 1 +- 1e-7), and
# the step, from the same formula, by the same order. Measured: steps within 3e-7 of each other
# (the step itself ~1e-2), metrics within 1e-6 relative.
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded, 2 micro-batches", "packed"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_one_pass_equals_the_separate_pass(cell, layout):
    budget, micro = (64, 1) if layout == "packed" else (0, 2)
    kw = dict(CELLS[cell], **({"segments_per_row": 2} if cell.startswith("gspo") and budget else {}))
    sep_step, sep_m, sep_b = _update("separate", budget, micro, **kw)
    one_step, one_m, one_b = _update("auto", budget, micro, **kw)
    assert sep_m.pop("old_logprob_pass") == 1.0 and one_m.pop("old_logprob_pass") == 0.0  # which path ran
    assert max(np.abs(s).max() for s in sep_step) > 1e-3  # the gradient is not zero
    for a, b in zip(one_step, sep_step):  # every gradient leaf
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    inside = np.arange(sep_b.tokens.shape[1])[None] < sep_b.lengths[:, None]
    for field in ("old_logprobs", "entropy"):
        np.testing.assert_allclose(np.where(inside, getattr(one_b, field), 0),
                                   np.where(inside, getattr(sep_b, field), 0), atol=1e-6)
    assert one_m.keys() == sep_m.keys()
    for k in sep_m:
        assert one_m[k] == pytest.approx(sep_m[k], rel=1e-5, abs=1e-6), k
    assert one_m["ppo_kl"] == 0.0  # exactly on policy: every ratio is 1 (the separate pass: 1 +- rounding)
    for name in kw.get("correction", CorrectionConfig()).names:  # each correction did something, not everything
        did = sep_m[f"correction/{name}/masked_fraction"] + sep_m[f"correction/{name}/clipped_fraction"]
        if CORRECTIONS[name].level == "sequence" or name in ("icepop", "token_mis", "token_tis"):
            assert 0 < did < 1, (name, did)


def test_one_pass_is_the_default_for_one_step_and_runs_no_separate_pass():
    learner = Learner(random_model(small_config("qwen3"), seed=3), LearnerSettings(), optimizer=optax.sgd(1.0))
    calls = []
    learner.batch_logprobs = lambda *a, **k: calls.append(a)  # a separate pass would call this
    batch = _batch(seed=4)
    metrics = learner.update(batch)
    assert metrics["old_logprob_pass"] == 0.0 and not calls
    assert batch.old_logprobs is not None and batch.entropy is not None  # filled from the update's pass
    assert metrics["ppo_kl"] == 0.0 and metrics["clip_low_fraction"] == metrics["clip_high_fraction"] == 0.0


def test_old_logprobs_the_batch_brings_are_used_as_they_are():
    learner = Learner(random_model(small_config("qwen3"), seed=3), LearnerSettings(lr=1e-2))
    batch = _batch(seed=4)
    batch.old_logprobs = learner.logprobs(batch.tokens) - 0.1 * (batch.loss_mask > 0)  # older weights'
    metrics = learner.update(batch)
    assert metrics["old_logprob_pass"] == 1.0 and metrics["ppo_kl"] == pytest.approx(-0.1, rel=1e-3)


@pytest.mark.parametrize("settings, why", [
    (dict(mini_batches=2), "optimizer steps"), (dict(epochs=2), "optimizer steps"),
    (dict(kl=KLConfig(coef=0.1)), "KL term")])
def test_auto_keeps_the_separate_pass_where_one_pass_is_not_exact_and_one_pass_is_refused_there(settings, why):
    assert not LearnerSettings(**settings).old_logprobs_in_update()
    problems = list(LearnerSettings(old_logprobs="one_pass", **settings).rules())
    assert any(field == "old_logprobs" and why in message for field, message in problems), problems
    learner = Learner(random_model(small_config("qwen3"), seed=3), LearnerSettings(lr=1e-3, **settings))
    assert learner.update(_batch(seed=5))["old_logprob_pass"] == 1.0
    with pytest.raises(ValueError, match=why):
        Learner(random_model(small_config("qwen3"), seed=3), LearnerSettings(old_logprobs="one_pass", **settings))


def test_lora_dropout_keeps_the_separate_pass_and_refuses_one_pass():
    from rstar2_jax.models.lora import LoRAConfig, attach
    model = attach(random_model(small_config("qwen3"), seed=3), LoRAConfig(rank=4, dropout=0.1), seed=0)
    assert Learner(model, LearnerSettings()).one_pass is False
    with pytest.raises(ValueError, match="LoRA dropout"):
        Learner(model, LearnerSettings(old_logprobs="one_pass"))
    plain = attach(random_model(small_config("qwen3"), seed=3), LoRAConfig(rank=4), seed=0)
    assert Learner(plain, LearnerSettings(old_logprobs="one_pass")).one_pass is True
