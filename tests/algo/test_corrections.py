"""Off-policy corrections (algo/corrections): each one's law as a property, each against its
peer's formula on fixed inputs (the source named), composition, and the metrics they report."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rstar2_jax.algo.aggregation import aggregate
from rstar2_jax.algo.corrections import (CORRECTIONS, CorrectionConfig, CorrectionInputs, apply_correction,
                                         combined_correction, compose, correction_metrics, effective_sample_size,
                                         mismatch_metrics)
from rstar2_jax.algo.corrections.decoupled import DecoupledSettings
from rstar2_jax.algo.corrections.importance import CapSettings
from rstar2_jax.algo.corrections.masks import BandSettings, GeoBandSettings
from rstar2_jax.core.config_types import ConfigValueError


def _inputs(log_ratio, mask=None, learner=None):
    log_ratio = np.asarray(log_ratio, np.float32)
    mask = np.ones(log_ratio.shape, bool) if mask is None else np.asarray(mask, bool)
    learner = np.full(log_ratio.shape, -1.0, np.float32) if learner is None else np.asarray(learner, np.float32)
    return CorrectionInputs(jnp.asarray(learner), jnp.asarray(learner - log_ratio), jnp.asarray(mask))


def _apply(name, settings, log_ratio, mask=None):
    c = apply_correction(name, _inputs(log_ratio, mask), settings)
    return np.asarray(c.weight), np.asarray(c.keep), np.asarray(c.clipped)


# every correction with settings drawn from its meaningful range
SETTINGS = {
    "token_tis": st.builds(CapSettings, cap=st.floats(1.0, 10.0)),
    "seq_tis": st.builds(CapSettings, cap=st.floats(1.0, 10.0)),
    "token_mis": st.builds(CapSettings, cap=st.floats(1.0, 10.0)),
    "seq_mis": st.builds(CapSettings, cap=st.floats(1.0, 10.0)),
    "icepop": st.builds(BandSettings, low=st.floats(0.05, 1.0), high=st.floats(1.0, 10.0)),
    "geo_mask": st.builds(GeoBandSettings, low=st.floats(0.5, 1.0), high=st.floats(1.0, 2.0)),
    "decoupled_ppo": st.builds(DecoupledSettings, cap=st.one_of(st.none(), st.floats(1.01, 10.0))),
}


def test_every_registered_correction_has_a_property_strategy():
    assert set(SETTINGS) == set(CORRECTIONS)


ROWS, LENGTH = 4, 6  # the one shape every drawn batch has


@st.composite
def batches(draw):
    """(log r, mask) of a batch of 1-4 rows of 1-6 positions, placed in a [4, 6] whose rest is
    padding (mask False, any log r): the corrections run eagerly, op by op, and each op compiles
    once per shape, so one shape keeps a law's 40-60 examples cheap (a shape each cost ~3x)."""
    rows, length = draw(st.integers(1, ROWS)), draw(st.integers(1, LENGTH))
    log_r = np.array(draw(st.lists(st.floats(-3.0, 3.0), min_size=ROWS * LENGTH, max_size=ROWS * LENGTH)),
                     np.float32).reshape(ROWS, LENGTH)
    mask = np.zeros((ROWS, LENGTH), bool)
    mask[:rows, :length] = np.array(draw(st.lists(st.booleans(), min_size=rows * length, max_size=rows * length)
                                         )).reshape(rows, length)
    return log_r, mask


# ---- laws ----------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(CORRECTIONS)), data=st.data(), batch=batches())
def test_identity_when_the_sampler_is_the_learner(name, data, batch):
    """On-policy (log r = 0 everywhere) every correction keeps every model token with weight 1."""
    _, mask = batch
    weight, keep, clipped = _apply(name, data.draw(SETTINGS[name]), np.zeros(mask.shape), mask)
    np.testing.assert_array_equal(keep, mask)
    np.testing.assert_allclose(weight[mask], 1.0, rtol=0, atol=1e-6)
    assert not clipped.any()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(CORRECTIONS)), data=st.data(), batch=batches())
def test_padding_is_never_kept_nor_weighted(name, data, batch):
    log_r, mask = batch
    log_r = np.where(mask, log_r, np.nan)  # garbage in padding must not leak
    inputs = CorrectionInputs(jnp.zeros(mask.shape), jnp.asarray(-log_r), jnp.asarray(mask))
    c = apply_correction(name, inputs, data.draw(SETTINGS[name]))
    assert np.isfinite(np.asarray(c.weight)).all()
    assert not np.asarray(c.keep)[~mask].any() and (np.asarray(c.weight)[~mask] == 0).all()


def _clear(log_x, *bounds):
    """Values farther than 1e-5 from every bound: at a bound itself, float32 (the correction) and
    float64 (this test) may round the comparison differently."""
    return np.all([np.abs(np.asarray(log_x, np.float64) - b) > 1e-5 for b in bounds], axis=0)


def _seq_log(log_r, mask):
    return np.where(mask, log_r, 0.0).astype(np.float64).sum(-1, keepdims=True) * np.ones_like(log_r)


@settings(max_examples=60, deadline=None)
@given(cap=st.floats(1.0, 10.0), batch=batches(), level=st.sampled_from(["token", "seq"]))
def test_truncated_weights_lie_in_zero_to_cap_and_clip_exactly_above_it(cap, batch, level):
    log_r, mask = batch
    weight, keep, clipped = _apply(f"{level}_tis", CapSettings(cap=cap), log_r, mask)
    ratio_log = log_r if level == "token" else _seq_log(log_r, mask)
    np.testing.assert_array_equal(keep, mask)  # TIS keeps every token
    assert (weight[mask] >= 0).all() and (weight[mask] <= cap * (1 + 1e-6)).all()
    clear = mask & _clear(ratio_log, math.log(cap))
    np.testing.assert_array_equal(clipped[clear], (ratio_log > math.log(cap))[clear])
    below = mask & ~clipped
    np.testing.assert_allclose(weight[below], np.exp(ratio_log[below]), rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(cap=st.floats(1.0, 10.0), batch=batches(), level=st.sampled_from(["token", "seq"]))
def test_masked_is_never_admits_a_ratio_above_its_cap(cap, batch, level):
    log_r, mask = batch
    weight, keep, _ = _apply(f"{level}_mis", CapSettings(cap=cap), log_r, mask)
    ratio_log = log_r if level == "token" else _seq_log(log_r, mask)
    assert (ratio_log[keep] <= math.log(cap) + 1e-5).all()          # nothing above the cap is kept
    assert (ratio_log[mask & ~keep] > math.log(cap) - 1e-5).all()   # nothing below it is dropped
    np.testing.assert_allclose(weight[keep], np.exp(ratio_log[keep]), rtol=1e-4)
    if level == "seq":  # a sequence is kept or dropped whole
        for row_keep, row_mask in zip(keep, mask):
            assert row_keep[row_mask].all() or not row_keep.any()


@settings(max_examples=60, deadline=None)
@given(low=st.floats(0.05, 1.0), high=st.floats(1.0, 10.0), batch=batches())
def test_icepop_keeps_exactly_the_tokens_inside_its_band(low, high, batch):
    log_r, mask = batch
    weight, keep, _ = _apply("icepop", BandSettings(low=low, high=high), log_r, mask)
    inside = (log_r >= math.log(low)) & (log_r <= math.log(high))
    clear = _clear(log_r, math.log(low), math.log(high))
    np.testing.assert_array_equal(keep[clear], (mask & inside)[clear])
    assert (weight[keep] >= low * (1 - 1e-5)).all() and (weight[keep] <= high * (1 + 1e-5)).all()


@settings(max_examples=60, deadline=None)
@given(low=st.floats(0.5, 1.0), high=st.floats(1.0, 2.0), batch=batches())
def test_geometric_mask_keeps_exactly_the_sequences_whose_mean_log_ratio_is_in_band(low, high, batch):
    log_r, mask = batch
    weight, keep, _ = _apply("geo_mask", GeoBandSettings(low=low, high=high), log_r, mask)
    geo = _seq_log(log_r, mask)[:, 0] / np.maximum(mask.sum(-1), 1)
    inside = (geo >= math.log(low) - 1e-6) & (geo <= math.log(high) + 1e-6)
    for i in range(len(mask)):
        if mask[i].any() and abs(geo[i] - math.log(low)) > 1e-5 and abs(geo[i] - math.log(high)) > 1e-5:
            assert keep[i][mask[i]].all() == inside[i] and keep[i].any() == inside[i]
    np.testing.assert_array_equal(weight[keep], 1.0)


@settings(max_examples=60, deadline=None)
@given(cap=st.one_of(st.none(), st.floats(1.01, 10.0)), batch=batches())
def test_decoupled_ppo_weighs_by_the_behaviour_ratio_and_drops_above_its_cap(cap, batch):
    log_r, mask = batch
    weight, keep, _ = _apply("decoupled_ppo", DecoupledSettings(cap=cap), log_r, mask)
    expected_keep = mask if cap is None else mask & (log_r <= math.log(cap))
    clear = np.ones(mask.shape, bool) if cap is None else _clear(log_r, math.log(cap))
    np.testing.assert_array_equal(keep[clear], expected_keep[clear])
    np.testing.assert_allclose(weight[keep], np.exp(log_r[keep]), rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(names=st.lists(st.sampled_from(sorted(CORRECTIONS)), min_size=2, max_size=3, unique=True), batch=batches())
def test_composition_multiplies_weights_ands_masks_and_is_order_free(names, batch):
    log_r, mask = batch
    cfg = CorrectionConfig(names=tuple(names))
    x = _inputs(log_r, mask)
    parts = [apply_correction(n, x, cfg.settings_of(n)) for n in names]
    both = combined_correction(names, cfg.settings_of, x)
    reverse = combined_correction(names[::-1], cfg.settings_of, x)
    keep = np.logical_and.reduce([np.asarray(p.keep) for p in parts])
    np.testing.assert_array_equal(np.asarray(both.keep), keep)
    np.testing.assert_allclose(np.asarray(both.weight), np.where(keep, np.prod([np.asarray(p.weight) for p in parts], 0),
                                                                 0.0), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(both.keep), np.asarray(reverse.keep))
    np.testing.assert_allclose(np.asarray(both.weight), np.asarray(reverse.weight), rtol=1e-6)
    assert np.asarray(compose([], mask.shape).keep).all()


# ---- against the peers' formulas, fixed inputs ------------------------------------------------------
# Ratios 3, 1/2, 1 and 8 (log-ratios ln 3, ln 0.5, 0, ln 8); row 0: 3, 1/2, 1; row 1: 8, 1, (pad)
LOG_R = np.log(np.array([[3.0, 0.5, 1.0], [8.0, 1.0, 1.0]], np.float32))
MASK = np.array([[True, True, True], [True, True, False]])


def test_token_tis_matches_verl_compute_rollout_correction_weights():
    """verl rollout_corr_helper.compute_rollout_correction_weights(rollout_is="token",
    rollout_is_threshold=2): w = min(exp(log_ratio), 2), 0 on padding."""
    weight, keep, clipped = _apply("token_tis", CapSettings(cap=2.0), LOG_R, MASK)
    np.testing.assert_allclose(weight, [[2.0, 0.5, 1.0], [2.0, 1.0, 0.0]], rtol=1e-6)
    np.testing.assert_array_equal(clipped, [[True, False, False], [True, False, False]])


def verl_rejection_keep(log_ratio, mask, option, threshold):
    """verl compute_rollout_rejection_mask (verl/trainer/ppo/rollout_corr_helper.py at
    volcengine/verl b178a3c) for its k1 sequence options: log_ratio = old - rollout, clamped to
    +-20 per token; k1 = -log_ratio; a sequence is kept when log(lower) <= stat <= log(upper), stat
    the masked sum ("seq_sum_k1") or mean ("seq_mean_k1") of k1. Returns the modified response mask."""
    lower, upper = (float(v) for v in threshold.split("_"))
    k1 = -np.clip(log_ratio, -20.0, 20.0)
    m = mask.astype(np.float64)
    total = (k1 * m).sum(-1)
    stat = total if option == "seq_sum_k1" else total / (m.sum(-1) + 1e-8)
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    return mask & keep[:, None]


def test_seq_tis_and_seq_mis_match_verl_sequence_level_weights_and_rejection():
    """verl: rollout_is="sequence" gives exp(sum log r) truncated at C, broadcast to the row. Row 0:
    R = 3 x 0.5 x 1 = 1.5; row 1: R = 8. seq_mis(C) keeps what verl's rollout_rs="seq_sum_k1" with
    "1/C_inf" keeps; verl's own preset "0.5_2.0" would also drop R < 1/2, which seq_mis keeps."""
    weight, keep, _ = _apply("seq_tis", CapSettings(cap=2.0), LOG_R, MASK)
    np.testing.assert_allclose(weight, [[1.5] * 3, [2.0, 2.0, 0.0]], rtol=1e-5)
    weight, keep, _ = _apply("seq_mis", CapSettings(cap=2.0), LOG_R, MASK)
    np.testing.assert_array_equal(keep, [[True] * 3, [False] * 3])
    np.testing.assert_array_equal(keep, verl_rejection_keep(LOG_R, MASK, "seq_sum_k1", "0.5_inf"))
    np.testing.assert_allclose(weight[0], [1.5] * 3, rtol=1e-5)
    low = np.log(np.array([[0.25, 1.0, 1.0]], np.float32))  # R = 1/4: kept by seq_mis, dropped by the preset
    _, keep, _ = _apply("seq_mis", CapSettings(cap=2.0), low, np.ones((1, 3), bool))
    assert keep.all() and not verl_rejection_keep(low, np.ones((1, 3), bool), "seq_sum_k1", "0.5_2.0").any()


@pytest.mark.parametrize("low,high", [(0.5, 1.2), (0.5, 1.1), (0.9, 1.5), (0.999, 1.001)])
def test_geo_mask_matches_verl_seq_mean_k1_with_its_bounds_inverted(low, high):
    """verl's geometric rejection (rollout_rs="seq_mean_k1", the decoupled_geo_rs preset) bounds
    exp(mean -log r), the inverse ratio: geo_mask's [low, high] is verl's "1/high_1/low". Row 0's
    geometric mean is (1.5)^(1/3) = 1.1447, row 1's 8^(1/2) = 2.83."""
    _, keep, _ = _apply("geo_mask", GeoBandSettings(low=low, high=high), LOG_R, MASK)
    np.testing.assert_array_equal(keep & MASK, verl_rejection_keep(LOG_R, MASK, "seq_mean_k1", f"{1 / high}_{1 / low}"))
    assert keep[0].all() == (low <= 1.5 ** (1 / 3) <= high)


def test_geo_mask_with_verls_bounds_as_written_drops_other_sequences():
    """The inversion matters for an asymmetric band: with [0.5, 1.2] written as verl's "0.5_1.2"
    (bounds on the inverse ratio), row 0 (geometric mean 1.1447, inverse 0.874) is kept by both,
    but a row of geometric mean 1.5 (inverse 0.667) is dropped by geo_mask and kept by verl."""
    row = np.log(np.full((1, 2), 1.5, np.float32))
    one = np.ones((1, 2), bool)
    _, keep, _ = _apply("geo_mask", GeoBandSettings(low=0.5, high=1.2), row, one)
    assert not keep.any() and verl_rejection_keep(row, one, "seq_mean_k1", "0.5_1.2").all()


def test_icepop_matches_the_ring_1t_mask():
    """IcePop (Ring-1T report; NeMo-RL `icepop`): M(k) = k on [0.5, 5], 0 outside."""
    weight, keep, _ = _apply("icepop", BandSettings(low=0.5, high=5.0), LOG_R, MASK)
    np.testing.assert_array_equal(keep, [[True, True, True], [False, True, False]])
    np.testing.assert_allclose(weight, [[3.0, 0.5, 1.0], [0.0, 1.0, 0.0]], rtol=1e-6)


def areal_ppo_actor_loss(pg_loss, proximal, behaviour, loss_mask, upper):
    """AReaL ppo_actor_loss_fn's rejection and aggregation (areal/utils/functional/functional.py
    at inclusionAI/AReaL 4aef98d) for RejectionSamplingConfig(level="token", action="mask",
    metric="ratio", upper): the count is taken before the drop; tokens whose behaviour weight
    exp(proximal - behaviour) exceeds `upper` leave loss_mask; pg_loss x weight summed over the
    remaining mask, over that count."""
    count = max(loss_mask.sum(), 1)
    weight = np.exp(proximal - behaviour)
    kept = loss_mask & (weight <= upper)
    return np.where(kept, pg_loss * np.where(kept, weight, 0.0), 0.0).sum() / count


def test_decoupled_ppo_matches_areal_behaviour_weight_and_differs_in_the_count_on_purpose():
    """AReaL: behav_imp_weight = exp(proximal - old); tokens with a weight above the cap are
    masked. Ours drops them from the count too (verl's rule for every rejection mask): under
    token_mean, ours x N_kept / N = AReaL's loss."""
    weight, keep, _ = _apply("decoupled_ppo", DecoupledSettings(cap=5.0), LOG_R, MASK)
    np.testing.assert_allclose(np.where(keep, weight, 0.0), [[3.0, 0.5, 1.0], [0.0, 1.0, 0.0]], rtol=1e-6)
    pg_loss = np.array([[0.3, -1.2, 0.7], [2.0, 0.4, 9.0]])
    learner = np.full(LOG_R.shape, -1.0)
    areal = areal_ppo_actor_loss(pg_loss, learner, learner - LOG_R, MASK, 5.0)
    ours = float(aggregate("token_mean", jnp.asarray(pg_loss * weight, jnp.float32), jnp.asarray(keep & MASK)))
    assert ours * (keep & MASK).sum() / MASK.sum() == pytest.approx(areal, rel=1e-5)
    assert ours != pytest.approx(areal, rel=1e-2)  # a token was dropped: the counts differ (4 against 5)


# ---- metrics ------------------------------------------------------------------------------------
def test_mismatch_metrics_are_k1_and_k3_per_token_and_per_sequence():
    m = mismatch_metrics(_inputs(LOG_R, MASK))
    r = np.array([3.0, 0.5, 1.0, 8.0, 1.0])
    k1, k3 = -np.log(r), r - 1 - np.log(r)
    assert m["mismatch/k1_token"] == pytest.approx(k1.mean(), rel=1e-5)
    assert m["mismatch/k3_token"] == pytest.approx(k3.mean(), rel=1e-5)
    assert m["mismatch/k1_seq"] == pytest.approx((k1[:3].sum() + k1[3:].sum()) / 2, rel=1e-5)
    assert m["mismatch/k3_seq"] == pytest.approx((k3[:3].sum() + k3[3:].sum()) / 2, rel=1e-5)
    on_policy = mismatch_metrics(_inputs(np.zeros((2, 3)), MASK))
    assert all(v == 0.0 for v in on_policy.values())


@settings(max_examples=50, deadline=None)
@given(w=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=20))
def test_effective_sample_size_is_a_fraction_and_one_for_equal_weights(w):
    w = np.array(w)
    ess = effective_sample_size(w, np.ones(w.shape, bool))
    assert 0.0 <= ess <= 1.0 + 1e-9
    assert effective_sample_size(np.full(w.shape, 0.7), np.ones(w.shape, bool)) == pytest.approx(1.0)


def test_correction_metrics_report_each_correction_and_the_combination():
    cfg = CorrectionConfig(names=("token_tis", "icepop", "seq_mis"))
    m = correction_metrics(cfg.names, cfg.settings_of, _inputs(LOG_R, MASK))
    assert m["correction/token_tis/clipped_fraction"] == pytest.approx(2 / 5)
    assert m["correction/icepop/masked_fraction"] == pytest.approx(1 / 5)
    assert m["correction/seq_mis/masked_fraction"] == pytest.approx(2 / 5)
    assert m["correction/seq_mis/seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["correction/masked_fraction"] == pytest.approx(2 / 5)  # row 1 dropped by seq_mis (icepop's token in it)
    assert 0 < m["correction/ess"] < 1


# ---- config --------------------------------------------------------------------------------------
def test_config_refuses_unknown_duplicate_and_out_of_range_corrections():
    _, problems = CorrectionConfig.parse({"names": ["token_tis", "token_tis", "tokn_mis"], "icepop": {"low": 0.0},
                                          "geo_mask": {"high": 0.9}, "decoupled_ppo": {"cap": 1.0}})
    paths = {p.path for p in problems}
    assert {"names", "names[2]", "icepop.low", "geo_mask.high", "decoupled_ppo.cap"} <= paths, problems
    with pytest.raises(ConfigValueError, match="token_mis.cap.*belongs to correction 'token_mis'"):
        CorrectionConfig.from_mapping({"names": ["token_tis"], "token_mis": {"cap": 3.0}})
    assert CorrectionConfig.from_mapping({"names": ["token_mis"], "token_mis": {"cap": 3.0}}).token_mis.cap == 3.0


def test_run_config_warns_where_a_correction_has_nothing_to_correct_and_moves_tis_cap():
    """A correction at k = 0 with the float32 embedded engine corrects nothing (a warning that
    says why); k > 0 without one warns too; the old rl.tis_cap is refused with the new setting."""
    from rstar2_jax.rl.config import RunConfig, base_config
    c = base_config()
    c.rl.correction.names = ("token_tis",)
    assert any("sampler and learner are the same policy" in w for w in RunConfig.from_config(c).warnings())
    c.model.dtype = "bfloat16"  # a bf16 engine samples with other numerics: nothing to warn about
    assert not any("same policy" in w for w in RunConfig.from_config(c).warnings())
    c = base_config()
    c.rl.max_staleness = 1
    assert any("without rl.correction.names" in w for w in RunConfig.from_config(c).warnings())
    c.rl.tis_cap = 2.0
    with pytest.raises(ConfigValueError, match=r"rl.tis_cap: is replaced by rl.correction.*token_tis.cap=2.0"):
        RunConfig.from_config(c)
