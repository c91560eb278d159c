"""The loss seam and every registered loss, aggregation and KL estimator against its published
formula (each reference transcribed in numpy below, its source named), plus the laws they obey."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax.algo import AGGREGATIONS, KL_ESTIMATORS, LOSSES, LossInputs, PolicyLossConfig, advantages, aggregate
from rstar2_jax.algo.losses import policy_loss_terms, stat_names
from rstar2_jax.algo.losses.cispo import CISPOSettings
from rstar2_jax.algo.losses.clip_higher import ClipHigherSettings
from rstar2_jax.algo.losses.gspo import GSPOSettings
from rstar2_jax.core.config_types import ConfigValueError


def _inputs(seed=0, rows=4, length=7, spread=0.3, adv=None):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (rows, length)).astype(np.float32)
    new = (old + rng.normal(0, spread, (rows, length))).astype(np.float32)
    mask = np.zeros((rows, length), bool)
    for i in range(rows):
        mask[i, 1:1 + int(rng.integers(1, length))] = True
    a = rng.normal(size=rows).astype(np.float32) if adv is None else np.asarray(adv, np.float32)
    return new, old, a, mask


def _terms(name, settings, new, old, adv, mask, **kw):
    inputs = LossInputs(jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), **kw)
    return policy_loss_terms(name, inputs, settings)


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


# ---- references, transcribed from their sources ---------------------------------------------
def verl_vanilla(old, new, adv, mask, low, high, c):
    """verl compute_policy_loss_vanilla (verl/trainer/ppo/core_algos.py), per token, before agg_loss."""
    neg_kl = np.clip(new - old, -20, 20)
    ratio = np.exp(neg_kl)
    a = adv[:, None]
    l1, l2 = -a * ratio, -a * np.clip(ratio, 1 - low, 1 + high)
    clip1 = np.maximum(l1, l2)
    clip2 = np.minimum(-a * c, clip1)
    return np.where(a < 0, clip2, clip1), _masked_mean(-neg_kl, mask)


def verl_gspo(old, new, adv, mask, low, high):
    """verl compute_policy_loss_gspo: the value of s_i,t = s_i on every token, then seq-mean-token-mean."""
    n = mask.sum(-1).clip(min=1)
    log_s = ((new - old) * mask).sum(-1) / n
    s = np.exp(np.minimum(log_s, 10.0))[:, None] * np.ones_like(new)
    a = adv[:, None]
    per_token = np.maximum(-a * s, -a * np.clip(s, 1 - low, 1 + high))
    return per_token


def verl_cispo(old, new, adv, mask, low, high):
    """verl compute_policy_loss_cispo: -sg(clip(ratio)) A log pi, per token."""
    ratio = np.exp(np.clip(new - old, -20, 20))
    return -np.clip(ratio, 1 - low, 1 + high) * adv[:, None] * new


def verl_agg_loss(loss_mat, mask, mode, scale=None):
    """verl agg_loss (verl/trainer/ppo/core_algos.py at volcengine/verl b178a3c), one process
    (dp_size 1, global sizes from the batch), transcribed mode by mode."""
    m = mask.astype(np.float64)
    seq_mask = (m.sum(-1) > 0).astype(np.float64)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return ((loss_mat * m).sum(-1) * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":  # torch.sum(seq_losses) / loss_scale_factor: no mean over sequences
        return (loss_mat * m).sum(-1).sum() / scale
    seq = (loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)
    return (seq * seq_mask).sum() / seq_mask.sum()


def schulman_kl(new, ref):
    """J. Schulman, "Approximating KL divergence" (2020): k1, k2, k3 with log r = log ref - log new;
    k3 clamped to +-10 as verl kl_penalty_forward does."""
    log_r = ref - new
    return {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": np.clip(np.exp(log_r) - 1 - log_r, -10, 10)}


# ---- each loss against its reference --------------------------------------------------------
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_clip_higher_equals_verl_vanilla_per_token_and_its_ppo_kl(dual_clip):
    new, old, adv, mask = _inputs(seed=1, spread=0.6)
    terms = _terms("clip_higher", ClipHigherSettings(dual_clip=dual_clip), new, old, adv, mask)
    # verl always applies c; c = infinity is "off"
    want, ppo_kl = verl_vanilla(old, new, adv, mask, 0.2, 0.28, dual_clip or np.inf)
    np.testing.assert_allclose(np.asarray(terms.per_token), np.where(mask, want, 0), rtol=1e-5, atol=1e-6)
    assert float(jnp.sum(terms.stats["ppo_kl"])) / mask.sum() == pytest.approx(ppo_kl, rel=1e-5)


def test_clip_higher_hand_computed_and_its_clip_split():
    # one sequence, ratios e^0, e^0.5, e^-0.5 and a masked token
    new = np.array([[0.0, 0.5, -0.5, 3.0]], np.float32)
    old, mask = np.zeros((1, 4), np.float32), np.array([[1, 1, 1, 0]], bool)
    ratio = np.exp([0.0, 0.5, -0.5])
    for a in (1.0, -1.0):
        terms = _terms("clip_higher", ClipHigherSettings(), new, old, [a], mask)
        want = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
        np.testing.assert_allclose(np.asarray(terms.per_token)[0, :3], want, rtol=1e-6)
        assert float(terms.per_token[0, 3]) == 0.0
        high, low = float(terms.stats["clip_high_fraction"].sum()), float(terms.stats["clip_low_fraction"].sum())
        # A > 0: ratio 1.65 clipped at 1.28 (above); A < 0: ratio 0.61 clipped at 0.8 (below)
        assert (high, low) == ((1.0, 0.0) if a > 0 else (0.0, 1.0))
    # dual clip caps the loss of negative advantages at -A * c
    terms = _terms("clip_higher", ClipHigherSettings(dual_clip=3.0), [[2.0]], [[0.0]], [-1.0], [[True]])
    assert float(terms.per_token[0, 0]) == pytest.approx(3.0)
    assert float(terms.stats["dual_clip_fraction"].sum()) == 1.0


def test_gspo_equals_verl_gspo_and_its_gradient_is_the_sequence_ratios():
    new, old, adv, mask = _inputs(seed=2, spread=0.001)
    s = GSPOSettings()
    terms = _terms("gspo", s, new, old, adv, mask)
    np.testing.assert_allclose(np.asarray(terms.per_token), np.where(mask, verl_gspo(old, new, adv, mask, 3e-4, 4e-4),
                                                                      0), rtol=1e-5, atol=1e-6)

    # eq. 5 differentiated: where unclipped, d/d logp_it of mean_i(-A_i s_i) = -A_i s_i / (n_i B)
    def loss(lp):
        t = _terms("gspo", s, lp, old, adv, mask)
        return aggregate("seq_mean_token_mean", t.per_token, jnp.asarray(mask))
    grad = np.asarray(jax.grad(loss)(jnp.asarray(new)))
    n = mask.sum(-1)
    s_i = np.exp(((new - old) * mask).sum(-1) / n)
    free = ~np.asarray(terms.stats["clip_low_fraction"] + terms.stats["clip_high_fraction"] > 0).any(-1)
    want = np.where(mask, (-adv * s_i / (n * len(n)))[:, None], 0.0)
    assert free.any()
    np.testing.assert_allclose(grad[free], want[free], rtol=1e-4, atol=1e-7)


def test_cispo_equals_verl_cispo_and_keeps_the_gradient_of_clipped_tokens():
    new, old, adv, mask = _inputs(seed=3, spread=0.8)
    s = CISPOSettings(eps_low=0.2, eps_high=0.28)
    terms = _terms("cispo", s, new, old, adv, mask)
    np.testing.assert_allclose(np.asarray(terms.per_token), np.where(mask, verl_cispo(old, new, adv, mask, 0.2, 0.28),
                                                                      0), rtol=1e-5, atol=1e-6)
    grad = np.asarray(jax.grad(lambda lp: jnp.sum(_terms("cispo", s, lp, old, adv, mask).per_token))(jnp.asarray(new)))
    clipped = np.asarray(terms.stats["clip_high_fraction"] + terms.stats["clip_low_fraction"] > 0) & mask
    assert clipped.any() and np.all(grad[clipped] != 0)  # a PPO clip would zero these


# ---- laws ----------------------------------------------------------------------------------
small = st.floats(-0.5, 0.5, allow_nan=False, width=32)


def _one_token_loss(name, settings, agg):
    """(value, gradient) of `name`'s aggregated loss on one-token responses, jitted once for the
    law below: 6 rows of [prompt token, response token], rows past the example's masked out."""
    def loss(new, old, adv, mask):
        return aggregate(agg, _terms(name, settings, new, old, adv, mask).per_token, mask)
    return jax.jit(jax.value_and_grad(loss))


_EPS = dict(eps_low=0.2, eps_high=0.28)
_GSPO_ONE_TOKEN = _one_token_loss("gspo", GSPOSettings(**_EPS), "seq_mean_token_mean")
_PPO_ONE_TOKEN = _one_token_loss("clip_higher", ClipHigherSettings(**_EPS), "token_mean")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(small, small, st.floats(-2, 2, width=32)), min_size=1, max_size=6))
def test_gspo_on_one_token_responses_is_token_ppo(rows):
    """GSPO paper, section 4: with |y_i| = 1 the sequence ratio is the token ratio."""
    pad = [(0.0, 0.0, 0.0)] * (6 - len(rows))
    old = jnp.array([[0.0, o] for o, _, _ in rows + pad], jnp.float32)
    new = jnp.array([[0.0, o + d] for o, d, _ in rows + pad], jnp.float32)
    adv = jnp.array([a for _, _, a in rows + pad], jnp.float32)
    mask = jnp.array([[False, i < len(rows)] for i in range(6)])
    (gspo, g_gspo), (ppo, g_ppo) = _GSPO_ONE_TOKEN(new, old, adv, mask), _PPO_ONE_TOKEN(new, old, adv, mask)
    assert float(gspo) == pytest.approx(float(ppo), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(g_gspo, g_ppo, rtol=1e-4, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(sorted(LOSSES)))
def test_every_loss_on_policy_has_the_reinforce_gradient(seed, name):
    """At pi = pi_old nothing clips: every loss's gradient is the policy gradient -A grad log pi,
    aggregated (the common ground of PPO, GSPO and CISPO at the first step of an update)."""
    new, _, adv, mask = _inputs(seed=seed)
    agg = PolicyLossConfig(name=name).aggregation_name()
    settings_ = LOSSES[name].settings()

    def loss(lp):
        return aggregate(agg, _terms(name, settings_, lp, new, adv, mask).per_token, jnp.asarray(mask))

    def reinforce(lp):
        return aggregate(agg, -jnp.asarray(adv)[:, None] * lp, jnp.asarray(mask))
    np.testing.assert_allclose(jax.grad(loss)(jnp.asarray(new)), jax.grad(reinforce)(jnp.asarray(new)),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_non_finite_values_in_padding_reach_neither_the_loss_nor_its_gradient(name):
    new, old, adv, mask = _inputs(seed=4)
    new, old = np.where(mask, new, np.nan), np.where(mask, old, np.inf)
    settings_ = LOSSES[name].settings()

    def loss(lp):
        return aggregate("token_mean", _terms(name, settings_, lp, old, adv, mask).per_token, jnp.asarray(mask))
    assert np.isfinite(float(loss(jnp.asarray(new))))
    assert np.all(np.isfinite(np.asarray(jax.grad(loss)(jnp.asarray(new)))))


def test_the_log_ratio_is_clamped_before_exp():
    """The issue's case: a log-ratio of 25 gives e^20 |A| (verl's clamp), not e^25 |A|."""
    terms = _terms("clip_higher", ClipHigherSettings(), [[25.0]], [[0.0]], [-1.0], [[True]])
    assert float(terms.per_token[0, 0]) == pytest.approx(np.exp(20.0), rel=1e-5)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(sorted(AGGREGATIONS)), st.sampled_from([1, 2, 4]))
def test_micro_batch_sums_over_the_whole_batchs_count_are_the_aggregated_loss(seed, agg, micro):
    """The update's rule: sum over micro-batches of scaled sums / count(whole) = aggregate(whole)."""
    rng = np.random.default_rng(seed)
    loss_mat = rng.normal(size=(8, 6)).astype(np.float32)
    mask = rng.random((8, 6)) < 0.6
    mask[rng.integers(0, 8)] = False  # a padding row
    a = AGGREGATIONS[agg]
    parts = [a.row_scale(jnp.asarray(m)) @ jnp.sum(jnp.where(m, x, 0), -1)
             for x, m in zip(np.split(loss_mat, micro), np.split(mask, micro))]
    total = sum(parts) / a.count(jnp.asarray(mask), 96.0)
    assert float(total) == pytest.approx(float(aggregate(agg, loss_mat, jnp.asarray(mask), 96.0)), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("ours,verls", [("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean"),
                                        ("seq_mean_token_sum", "seq-mean-token-sum")])
def test_aggregations_equal_verl_agg_loss(ours, verls):
    rng = np.random.default_rng(5)
    loss_mat, mask = rng.normal(size=(6, 9)), rng.random((6, 9)) < 0.5
    mask[2] = False
    want = verl_agg_loss(loss_mat, mask, verls, scale=400.0)
    assert float(aggregate(ours, jnp.asarray(loss_mat, jnp.float32), jnp.asarray(mask), 400.0)) == \
        pytest.approx(want, rel=1e-5)


def test_constant_is_verls_token_sum_norm_over_the_number_of_sequences():
    """Where we differ on purpose: verl's "seq-mean-token-sum-norm" is sum l / C for the whole
    batch; `constant` keeps Dr. GRPO's 1/G (arXiv 2503.20783), sum l / (sequences x C). Rows with
    no model token count in neither."""
    rng = np.random.default_rng(5)
    loss_mat, mask = rng.normal(size=(6, 9)), rng.random((6, 9)) < 0.5
    mask[2] = False
    verl = verl_agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", scale=400.0)
    ours = float(aggregate("constant", jnp.asarray(loss_mat, jnp.float32), jnp.asarray(mask), 400.0))
    sequences = int((mask.sum(-1) > 0).sum())
    assert sequences == 5
    assert ours == pytest.approx(verl / sequences, rel=1e-5)
    assert ours != pytest.approx(verl, rel=1e-2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0]) | st.floats(-3, 3), min_size=2, max_size=16))
def test_dr_grpo_advantages_are_reward_minus_the_group_mean(rewards):
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, eq. 3): A_i = r_i - mean(r), no std division."""
    r = np.asarray(rewards, np.float64)
    np.testing.assert_allclose(advantages("mean_only", rewards), r - r.mean(), rtol=1e-5, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-8, 0, width=32), st.floats(-8, 0, width=32)), min_size=1, max_size=8))
def test_kl_estimators_are_schulmans_and_k2_k3_are_never_negative(pairs):
    pairs = pairs + pairs[:1] * (8 - len(pairs))  # one shape: the estimators run eagerly, compiling per shape
    new = jnp.asarray([p[0] for p in pairs])
    ref = jnp.asarray([p[1] for p in pairs])
    want = schulman_kl(np.asarray(new, np.float64), np.asarray(ref, np.float64))
    for name, fn in KL_ESTIMATORS.items():
        np.testing.assert_allclose(fn(new, ref), want[name], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(fn(new, new), 0.0, atol=1e-7)
    assert np.all(np.asarray(KL_ESTIMATORS["k2"](new, ref)) >= 0)
    assert np.all(np.asarray(KL_ESTIMATORS["k3"](new, ref)) >= -1e-6)


# ---- the seam's contract -------------------------------------------------------------------
def test_a_loss_must_return_exactly_the_statistics_it_declares():
    from rstar2_jax.algo.losses.base import LossTerms, register_loss

    @register_loss("test_liar", settings=ClipHigherSettings, stats=("clip_high_fraction",))
    def liar(inputs, s):
        return LossTerms(-inputs.token_advantages * inputs.logprobs, {})
    try:
        with pytest.raises(ValueError, match="declared"):
            _terms("test_liar", ClipHigherSettings(), [[0.0]], [[0.0]], [1.0], [[True]])
    finally:
        del LOSSES["test_liar"]
    assert stat_names("clip_higher") == ("clip_low_fraction", "clip_high_fraction", "dual_clip_fraction", "ppo_kl")


@pytest.mark.parametrize("overrides,problem", [
    ({"name": "gspo", "clip_higher": {"eps_high": 0.3}}, "clip_higher.eps_high: belongs to policy loss 'clip_higher', but "
                                                         "rl.loss.name is 'gspo'"),
    ({"name": "gspo", "aggregation": "token_mean"}, "aggregation: loss 'gspo' is defined with seq_mean_token_mean only"),
    ({"name": "ppo"}, "name: unknown policy loss 'ppo'"),
    ({"aggregation": "token_sum"}, "aggregation: unknown loss aggregation 'token_sum'"),
    ({"clip_higher": {"dual_clip": 1.0}}, "clip_higher.dual_clip: must be > 1"),
])
def test_loss_config_errors_name_the_field_and_the_fix(overrides, problem):
    with pytest.raises(ConfigValueError) as e:
        PolicyLossConfig.from_mapping(overrides)
    assert problem in str(e.value)


def test_each_loss_declares_a_settings_section_that_rl_loss_carries():
    cfg = PolicyLossConfig()
    for name, spec in LOSSES.items():
        assert dataclasses.asdict(getattr(cfg, name)) == dataclasses.asdict(spec.settings())


def test_reinforce_equals_verl_gpg():
    """verl compute_policy_loss_gpg: -log pi x A per token (GPG, arXiv 2504.02546)."""
    new, old, adv, mask = _inputs(seed=6)
    terms = _terms("reinforce", LOSSES["reinforce"].settings(), new, old, adv, mask)
    np.testing.assert_allclose(np.asarray(terms.per_token), np.where(mask, -new * adv[:, None], 0), rtol=1e-6)


def test_combinations_that_cannot_work_are_listed_with_the_other_errors_and_idle_settings_warned():
    from rstar2_jax.rl.config import RunConfig, base_config
    c = base_config()
    c.rl.batch_problems, c.rl.group_size, c.rl.mini_batches = 2, 2, 5
    c.rl.loss.name, c.rl.loss.aggregation = "gspo", "constant"
    c.rl.loss.cispo.eps_high = 9.0
    with pytest.raises(ConfigValueError) as e:
        RunConfig.from_config(c)
    text = str(e.value)
    assert "rl.mini_batches: 5 mini-batches cannot split" in text
    assert "rl.loss.aggregation: loss 'gspo' is defined with seq_mean_token_mean only" in text
    assert "rl.loss.cispo.eps_high: belongs to policy loss 'cispo'" in text
    c = base_config()
    c.rl.kl.place = "reward"
    assert any("rl.kl.coef is 0" in w for w in RunConfig.from_config(c).warnings())
