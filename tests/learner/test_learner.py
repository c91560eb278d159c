"""Learner: exact accumulation, loss goes down, old log-probs, optimizer reset, batching."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from rstar2_jax.learner import Learner, LearnerSettings, UpdateConfig, make_batch
from tests.models.conftest import random_model, small_config


def _batch(seed=0, rows=8, length=40, vocab=257, rows_multiple=4):
    rng = np.random.default_rng(seed)
    tokens = [list(rng.integers(1, vocab, size=int(rng.integers(10, length)))) for _ in range(rows)]
    masks = [[0] * 5 + [1] * (len(t) - 5) for t in tokens]
    logps = [[0.0] * len(t) for t in tokens]
    adv = list(rng.normal(size=rows))
    return make_batch(tokens, masks, logps, adv, pad_multiple=16, rows_multiple=rows_multiple)


def _params_flat(learner):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(learner.state.params)])


# The exactness tests step with plain SGD (lr 1): the step is the accumulated gradient itself.
# Adam's first step is lr * g / (|g| + eps), which turns float32 summation-order noise in a
# gradient near eps into a difference of up to ~lr: what it shows depends on the CPU's kernels.
SGD = optax.sgd(1.0)


@pytest.mark.slow
def test_micro_batch_accumulation_is_exact():
    cfg = small_config("qwen3")
    results = []
    for micro in (1, 2, 4):
        learner = Learner(random_model(cfg, seed=1), LearnerSettings(micro_batches=micro), optimizer=SGD)
        start = _params_flat(learner)
        metrics = learner.update(_batch())
        results.append((_params_flat(learner) - start, metrics))
    assert np.abs(results[0][0]).max() > 1e-3  # the gradient is not zero
    for step, metrics in results[1:]:
        np.testing.assert_allclose(step, results[0][0], rtol=1e-4, atol=1e-7)
        assert metrics["grad_norm"] == pytest.approx(results[0][1]["grad_norm"], rel=1e-5)


def test_old_logprob_pass_by_micro_batches_equals_the_whole_batch():
    """The old-log-prob pass runs micro-batch by micro-batch (memory), with the same result."""
    cfg, batch = small_config("qwen3"), _batch(seed=3)
    out = {}
    for micro in (1, 4):
        learner = Learner(random_model(cfg, seed=2), LearnerSettings(micro_batches=micro))
        out[micro] = learner.logprobs(batch.tokens, with_entropy=True)
    for whole, split in zip(out[1], out[4]):
        np.testing.assert_allclose(split, whole, atol=1e-6)


def _policy_loss(learner, arrays) -> float:
    """The aggregated policy loss of a batch under the learner's weights (no gradient, no
    corrections): the registered loss on its log-probs, aggregated as configured."""
    from rstar2_jax.algo import LossInputs, aggregate, policy_loss_terms
    from rstar2_jax.learner.train_step import compute_logprobs
    cfg = learner.update_cfg
    lp = compute_logprobs(learner.graphdef, learner.state.params, arrays["tokens"], cfg, remat=False)
    mask = arrays["loss_mask"] > 0
    terms = policy_loss_terms(cfg.loss.name, LossInputs(lp, arrays["old_logprobs"], arrays["advantages"], mask),
                              cfg.loss.settings())
    return float(aggregate(cfg.loss.aggregation_name(), terms.per_token, mask, cfg.constant_tokens))


@pytest.mark.slow
def test_updates_reduce_the_policy_loss_on_a_fixed_batch():
    learner = Learner(random_model(small_config("qwen3"), seed=2), LearnerSettings(lr=3e-3, warmup_steps=1))
    batch = _batch(seed=3)
    batch.old_logprobs = learner.logprobs(batch.tokens)
    arrays = {"tokens": batch.tokens, "loss_mask": batch.loss_mask, "advantages": batch.advantages,
              "old_logprobs": batch.old_logprobs}
    before = _policy_loss(learner, arrays)
    for _ in range(5):
        learner.update(dataclasses.replace(batch))
    after = _policy_loss(learner, arrays)
    assert after < before - 0.01
    assert learner.version == 5 and int(learner.state.step) == 5


def test_old_logprobs_match_the_sampler_for_the_same_weights():
    model = random_model(small_config("qwen3"), seed=4)
    learner = Learner(model, LearnerSettings())
    batch = _batch(seed=5)
    lp = learner.logprobs(batch.tokens)
    batch.sampler_logprobs = np.where(batch.loss_mask > 0, lp, 0.0).astype(np.float32)
    metrics = learner.update(batch)
    assert metrics["logprob_mismatch_max"] < 1e-5 and metrics["importance_ratio_std"] < 1e-5


def test_update_returns_the_entropies_of_the_weights_it_started_from():
    model = random_model(small_config("qwen3"), seed=7)
    learner = Learner(model, LearnerSettings(lr=1e-2, warmup_steps=1))
    batch = _batch(seed=8)
    lp, ent = learner.logprobs(batch.tokens, with_entropy=True)
    np.testing.assert_allclose(lp, learner.logprobs(batch.tokens), atol=1e-6)  # same pass, same log-probs
    metrics = learner.update(batch)
    np.testing.assert_allclose(batch.entropy, ent, atol=1e-5)  # filled from the pre-update weights
    m = batch.loss_mask > 0
    assert (batch.entropy[m] > 0).all() and (batch.entropy[m] <= np.log(model.cfg.vocab_size) + 1e-4).all()
    assert metrics["entropy_mean"] == pytest.approx(float(ent[m].mean()), rel=1e-5)


def test_update_without_token_entropy_runs_the_plain_log_prob_pass():
    model = random_model(small_config("qwen3"), seed=7)
    learner = Learner(model, LearnerSettings(token_entropy=False))
    batch = _batch(seed=8)
    want = learner.logprobs(batch.tokens)
    metrics = learner.update(batch)
    assert batch.entropy is None and "entropy_mean" not in metrics
    np.testing.assert_array_equal(batch.old_logprobs, want)


def test_reset_optimizer_zeroes_the_moments():
    learner = Learner(random_model(small_config("qwen3"), seed=6), LearnerSettings(lr=1e-3, warmup_steps=1))
    learner.update(_batch())
    mu = lambda: max(float(np.abs(x).max()) for x in jax.tree.leaves(learner.state.opt_state)
                     if hasattr(x, "ndim") and x.ndim > 0)
    assert mu() > 0
    learner.reset_optimizer()
    assert mu() == 0


def test_make_batch_pads_and_aligns():
    b = make_batch([[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 1]], [[0, -1, -2], [0, -3]], [1.0, -1.0],
                   pad_multiple=4, rows_multiple=4)
    assert b.tokens.shape == (4, 4) and b.loss_mask.shape == (4, 4)
    np.testing.assert_array_equal(b.tokens[0], [1, 2, 3, 0])
    np.testing.assert_array_equal(b.loss_mask[1], [0, 1, 0, 0])
    np.testing.assert_array_equal(b.loss_mask[2:], 0)
    assert b.num_tokens == 3
    with pytest.raises(ValueError, match="differ in length"):
        make_batch([[1, 2]], [[1]], [[0, 0]], [0.0])


def test_make_batch_pads_rows_to_their_multiple_but_not_past_max_rows_nor_below_the_rows_given():
    rows = [[1, 2, 3]] * 5
    batch = lambda pad_multiple=4, **kw: make_batch(rows, [[0, 1, 1]] * 5, [[0.0] * 3] * 5, [1.0] * 5,
                                                    pad_multiple=pad_multiple, **kw)
    assert batch(rows_multiple=4).tokens.shape == (8, 4)
    assert batch(rows_multiple=4, max_rows=6).tokens.shape == (6, 4)
    assert batch(rows_multiple=4, max_rows=3).tokens.shape == (5, 4)
    assert batch(pad_multiple=128, max_len=64).tokens.shape == (5, 64)  # the width, as the rows, never past its cap


@pytest.mark.slow
def test_an_update_on_rows_padded_wider_and_to_more_rows_equals_the_tight_one():
    """The trainer pads each update to few shapes (rl.pad_width_multiple, rl.pad_rows_multiple:
    fewer compiles); the padding is masked, so the update is the same. seq_mean_token_mean counts
    sequences: a padding row counted as one would scale the step."""
    from rstar2_jax.algo import PolicyLossConfig
    rng = np.random.default_rng(31)
    tokens = [list(rng.integers(1, 257, size=int(rng.integers(10, 40)))) for _ in range(6)]
    args = (tokens, [[0] * 5 + [1] * (len(t) - 5) for t in tokens], [[0.0] * len(t) for t in tokens],
            list(rng.normal(size=6)))
    steps = []
    for pad_multiple, rows_multiple in ((1, 1), (64, 16)):
        learner = _learner(seed=1, loss=PolicyLossConfig(name="clip_higher", aggregation="seq_mean_token_mean"),
                           optimizer=SGD)
        start = _params_flat(learner)
        batch = make_batch(*args, pad_multiple=pad_multiple, rows_multiple=rows_multiple)
        metrics = learner.update(batch)
        steps.append((_params_flat(learner) - start, metrics, batch.tokens.shape))
    assert steps[0][2] == (6, max(map(len, tokens))) and steps[1][2] == (16, 64)
    assert np.abs(steps[0][0]).max() > 1e-4  # the gradient is not zero
    # float32 sums over other shapes reorder: equal within 1e-5 of the update's own scale (a padding
    # row counted as a sequence would scale it by 6/7; an absolute 1e-7 failed by 1.2e-7 on one of
    # 119,360 elements on this VM's CPU)
    scale = np.abs(steps[0][0]).max()
    np.testing.assert_allclose(steps[1][0], steps[0][0], rtol=1e-4, atol=1e-5 * scale)
    assert steps[1][1]["policy_loss"] == pytest.approx(steps[0][1]["policy_loss"], rel=1e-5, abs=1e-7)


def _update_with(names=(), sampler_shift=0.0, seed=11, micro_batches=1, **settings):
    from rstar2_jax.algo.corrections import CorrectionConfig
    cfg = small_config("qwen3")
    correction = CorrectionConfig(names=tuple(names), **settings)
    learner = Learner(random_model(cfg, seed=seed), LearnerSettings(lr=1e-3, warmup_steps=1, correction=correction,
                                                                      micro_batches=micro_batches))
    batch = _batch(seed=12)
    lp = learner.logprobs(batch.tokens)
    # the sampler's log-probs: the learner's own (same weights, on-policy), optionally shifted
    shift = sampler_shift * np.random.default_rng(0).standard_normal(lp.shape).astype(np.float32)
    batch.sampler_logprobs = np.where(batch.loss_mask > 0, lp + shift, 0.0).astype(np.float32)
    metrics = learner.update(batch)
    return _params_flat(learner), metrics


@pytest.mark.slow
def test_corrections_on_policy_are_bit_identical_to_the_plain_update():
    """Staleness 0 and no correction is the paper's update; on-policy (sampler == learner) every
    correction weighs every token by exactly 1 and drops none, so it is the same update bit for bit."""
    plain, m_plain = _update_with()
    on_policy, m_on = _update_with(("token_tis", "seq_mis", "icepop", "geo_mask"))
    np.testing.assert_array_equal(plain, on_policy)
    assert m_on["correction/weight_mean"] == pytest.approx(1.0, abs=1e-6) and m_on["correction/masked_fraction"] == 0
    assert m_on["correction/ess"] == pytest.approx(1.0) and m_on["mismatch/k3_token"] == pytest.approx(0.0, abs=1e-9)
    assert "correction/ess" not in m_plain and "mismatch/k1_token" in m_plain  # mismatch is always reported


@pytest.mark.slow
def test_correction_reweights_tokens_when_the_sampler_differs():
    plain, _ = _update_with(sampler_shift=0.5)
    corrected, m = _update_with(("token_tis",), sampler_shift=0.5)
    assert np.abs(plain - corrected).max() > 1e-6  # the update moved
    assert 0.0 < m["correction/token_tis/clipped_fraction"] < 1.0 and m["correction/weight_mean"] <= 2.0
    assert m["importance_ratio_max"] > 2.0  # the mismatch metrics see what the cap cut


@pytest.mark.slow
def test_dropped_tokens_leave_the_loss_and_its_count_and_micro_batching_stays_exact():
    """A mask that drops tokens is the update on the batch with those tokens masked out, weighted
    (token_mean's count is the kept tokens); a sequence-level mask is exact under micro-batches."""
    from rstar2_jax.algo.corrections import CorrectionConfig, CorrectionInputs, combined_correction
    from rstar2_jax.algo.corrections.importance import CapSettings
    from rstar2_jax.learner.train_step import corrected
    cfg = UpdateConfig.of(LearnerSettings(correction=CorrectionConfig(names=("icepop",))), temperature=1.0)
    rng = np.random.default_rng(3)
    mask = rng.random((4, 9)) < 0.8
    old = rng.normal(-2, 0.5, (4, 9)).astype(np.float32)
    sampler = (old + rng.normal(0, 1.0, (4, 9))).astype(np.float32)
    batch = {"loss_mask": mask.astype(np.float32), "old_logprobs": old, "sampler_logprobs": sampler}
    out = corrected(cfg, batch)
    c = combined_correction(("icepop",), cfg.correction.settings_of, CorrectionInputs(old, sampler, mask))
    np.testing.assert_array_equal(np.asarray(out["loss_mask"]) > 0, np.asarray(c.keep))
    assert 0 < np.asarray(out["loss_mask"]).sum() < mask.sum()  # some dropped, some kept
    whole, m1 = _update_with(("seq_mis", "token_tis"), sampler_shift=0.05, seq_mis=CapSettings(cap=1.05))
    split, m4 = _update_with(("seq_mis", "token_tis"), sampler_shift=0.05, micro_batches=4, seq_mis=CapSettings(cap=1.05))
    assert 0 < m1["correction/seq_mis/seq_masked_fraction"] < 1
    np.testing.assert_allclose(split, whole, atol=1e-5)
    assert m4["policy_loss"] == pytest.approx(m1["policy_loss"], rel=1e-5, abs=1e-7)


def _learner(seed=21, lr=1e-3, optimizer=None, **kw):
    return Learner(random_model(small_config("qwen3"), seed=seed), LearnerSettings(lr=lr, warmup_steps=1, **kw),
                   optimizer=optimizer)


def test_one_mini_batch_and_one_epoch_is_one_step_where_the_clip_cannot_bind():
    """The paper's setting: the old log-probs are the weights being updated, so every ratio is 1."""
    m = _learner().update(_batch(seed=22))
    assert m["optimizer_steps"] == 1
    assert m["clip_low_fraction"] == m["clip_high_fraction"] == 0.0 and abs(m["ppo_kl"]) < 1e-6


def test_mini_batches_times_epochs_steps_and_the_clip_binds_after_the_first():
    learner = _learner(lr=3e-2, mini_batches=2, epochs=2)
    m = learner.update(_batch(seed=22))
    assert m["optimizer_steps"] == 4 and learner.version == 1  # one update, one version
    assert m["clip_low_fraction"] + m["clip_high_fraction"] > 0 and m["ppo_kl"] != 0.0


def test_an_all_padding_mini_batch_takes_no_optimizer_step():
    b = _batch(seed=23, rows=2, rows_multiple=1)  # 2 rows over 4 mini-batches: two are padding only
    assert _learner(mini_batches=4).update(b)["optimizer_steps"] == 2


def test_kl_term_is_zero_against_itself_then_grows_and_the_reference_stays_frozen():
    from rstar2_jax.algo import KLConfig
    learner = _learner(lr=3e-2, kl=KLConfig(coef=0.5, estimator="k3"))
    ref = [np.asarray(x).copy() for x in jax.tree.leaves(learner.ref_params)]
    first = learner.update(_batch(seed=24))
    second = learner.update(_batch(seed=24))
    assert first["kl_ref_k3"] == pytest.approx(0.0, abs=1e-7) and second["kl_ref_k3"] > 1e-6
    for before, after in zip(ref, jax.tree.leaves(learner.ref_params)):
        np.testing.assert_array_equal(before, np.asarray(after))
    assert _learner().ref_params is None  # no KL term: no reference copy


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_micro_batch_accumulation_is_exact_for_every_aggregation(loss):
    from rstar2_jax.algo import PolicyLossConfig
    results = []
    for micro in (1, 4):
        learner = _learner(seed=1, loss=PolicyLossConfig(name=loss), micro_batches=micro, optimizer=SGD)
        start = _params_flat(learner)
        metrics = learner.update(_batch())
        results.append((_params_flat(learner) - start, metrics))
    assert np.abs(results[0][0]).max() > 1e-4  # the gradient is not zero
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-4, atol=1e-7)
    assert results[1][1]["policy_loss"] == pytest.approx(results[0][1]["policy_loss"], rel=1e-5, abs=1e-7)


def test_sequence_kl_is_zero_against_the_reference_itself_and_its_log_probs_are_reused():
    from rstar2_jax.algo import KLConfig
    learner = _learner(lr=3e-2, kl=KLConfig(coef=0.5, estimator="k1", place="reward"))
    batch = _batch(seed=25)
    np.testing.assert_allclose(learner.sequence_kl(batch), 0.0, atol=1e-5)
    assert batch.old_logprobs is not None  # computed once, for the update too
    m = learner.update(batch)
    assert "kl_ref_k1" not in m  # in the reward, not in the loss
    after = _batch(seed=25)
    kl = learner.sequence_kl(after)
    lp = learner.logprobs(after.tokens)
    ref = learner.logprobs(after.tokens, params=learner.ref_params)
    np.testing.assert_allclose(kl, ((lp - ref) * after.loss_mask).sum(-1), rtol=1e-5, atol=1e-6)
    assert np.abs(kl).max() > 1e-4


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_old_logprob_pass_by_micro_batches_runs_on_a_rematerialised_model(remat):
    """The recipes train with remat and micro-batches: the log-prob pass's lax.map once failed on
    such a model (nnx.remat inside lax.map: 'Cannot mutate Param from a different trace level')."""
    import jax.numpy as jnp
    from flax import nnx

    from rstar2_jax.models.decoder import Decoder
    from rstar2_jax.models.tiny import tiny_config
    batch = _batch(seed=7, vocab=320)
    expected = Learner(Decoder(tiny_config(), dtype=jnp.float32, rngs=nnx.Rngs(0)), LearnerSettings()).logprobs(
        batch.tokens)
    model = Decoder(tiny_config(), dtype=jnp.float32, rngs=nnx.Rngs(0), remat=remat)
    got = Learner(model, LearnerSettings(micro_batches=4)).logprobs(batch.tokens)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_constant_aggregation_without_c_is_refused_not_run_with_an_arbitrary_one():
    """Issue 71 item 4: C of aggregation=constant has one source, rl.loss.constant_tokens or the run's
    largest response budget (RunConfig.constant_tokens); a learner given neither refuses (it used
    to run with C = 1, a second default)."""
    from rstar2_jax.algo import PolicyLossConfig
    constant = LearnerSettings(loss=PolicyLossConfig(aggregation="constant"))
    with pytest.raises(ValueError, match="rl.loss.constant_tokens"):
        Learner(random_model(small_config("qwen3"), seed=1), constant)
    given = Learner(random_model(small_config("qwen3"), seed=1), constant, constant_tokens=512)
    from_settings = Learner(random_model(small_config("qwen3"), seed=1), LearnerSettings(
        loss=PolicyLossConfig(aggregation="constant", constant_tokens=256)))
    assert (given.update_cfg.constant_tokens, from_settings.update_cfg.constant_tokens) == (512, 256)
    plain = Learner(random_model(small_config("qwen3"), seed=1), LearnerSettings(micro_batches=2), temperature=0.7)
    assert (plain.update_cfg.micro_batches, plain.update_cfg.temperature) == (2, 0.7)  # the settings', as given
