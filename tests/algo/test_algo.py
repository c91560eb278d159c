"""RoC selection statistics, advantages and the clip-higher loss against hand-computed values."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rstar2_jax.algo import advantages, clip_higher_loss, group_is_informative, kl_penalty, roc_select

groups = st.integers(2, 32).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n),
    st.lists(st.floats(0, 2), min_size=n, max_size=n),
    st.integers(1, n), st.integers(0, 2**31 - 1)))


@settings(max_examples=300, deadline=None)
@given(groups, st.sampled_from(["paper", "off", "release"]))
def test_selection_counts(group, mode):
    rewards, penalties, keep, seed = group
    idx = roc_select(rewards, penalties, keep, np.random.default_rng(seed), mode)
    n = len(rewards)
    assert len(set(idx.tolist())) == len(idx) and all(0 <= i < n for i in idx)
    assert list(idx) == sorted(idx)
    if mode != "release":
        assert len(idx) == min(keep, n)
    else:
        assert len(idx) in (min(keep, n), n)
    if mode == "paper" and keep < n:
        r = np.asarray(rewards)
        neg, pos = int((r <= 0).sum()), int((r > 0).sum())
        want_neg = min(int(round(keep * neg / n)), neg)
        want_neg = keep - min(keep - want_neg, pos)
        assert int((r[idx] <= 0).sum()) == want_neg


def test_paper_mode_keeps_half_of_each_side():
    rewards = [1] * 6 + [0] * 10
    for seed in range(20):
        idx = roc_select(rewards, np.zeros(16), 8, np.random.default_rng(seed))
        assert (np.asarray(rewards)[idx] > 0).sum() == 3 and (np.asarray(rewards)[idx] <= 0).sum() == 5


def test_negatives_are_uniform():
    rewards = [1] * 8 + [0] * 8
    penalties = np.linspace(0, 1, 16)  # must not matter for negatives
    counts = np.zeros(16)
    for seed in range(4000):
        counts[roc_select(rewards, penalties, 8, np.random.default_rng(seed))] += 1
    neg = counts[8:] / 4000
    np.testing.assert_allclose(neg, 0.5, atol=0.04)


def test_positives_prefer_low_penalty_in_proportion_to_inverse_penalty():
    rewards = [1, 1, 1, 0, 0, 0]
    penalties = np.array([0.0, 0.5, 1.0, 0, 0, 0])
    eps = 0.1
    counts = np.zeros(6)
    trials = 6000
    for seed in range(trials):  # keep 2 of 6: one positive, one negative
        counts[roc_select(rewards, penalties, 2, np.random.default_rng(seed), eps=eps)] += 1
    w = 1 / (penalties[:3] + eps)
    np.testing.assert_allclose(counts[:3] / trials, w / w.sum(), atol=0.02)


def test_release_mode_is_deterministic_and_matches_the_released_rule():
    rewards = np.array([1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1])  # 10 pos, 6 neg
    penalties = np.arange(16)[::-1] / 16
    a = roc_select(rewards, penalties, 8, np.random.default_rng(0), "release")
    b = roc_select(rewards, penalties, 8, np.random.default_rng(1), "release")
    np.testing.assert_array_equal(a, b)
    pos = sorted(np.flatnonzero(rewards > 0), key=lambda i: penalties[i])[:round(10 * 8 / 16)]
    neg = sorted(np.flatnonzero(rewards <= 0), key=lambda i: penalties[i])[:round(6 * 8 / 16)]
    np.testing.assert_array_equal(a, sorted(pos + neg))
    # one positive in 16: proportional count 0 < min 2 -> the minimum (1 available) is taken
    r2 = np.array([1] + [0] * 15)
    idx = roc_select(r2, np.zeros(16), 8, np.random.default_rng(0), "release")
    assert len(idx) == 8 and 0 in idx


def test_off_mode_is_uniform():
    counts = np.zeros(8)
    for seed in range(4000):
        counts[roc_select([1, 1, 1, 1, 0, 0, 0, 0], np.arange(8.0), 4, np.random.default_rng(seed), "off")] += 1
    np.testing.assert_allclose(counts / 4000, 0.5, atol=0.04)


def test_bad_mode_and_shapes():
    with pytest.raises(ValueError, match="unknown RoC mode"):
        roc_select([1, 0], [0, 0], 1, np.random.default_rng(0), "best")
    with pytest.raises(ValueError, match="differ in shape"):
        roc_select([1, 0], [0], 1, np.random.default_rng(0))


def test_group_is_informative():
    assert not group_is_informative([1, 1, 1]) and not group_is_informative([0, 0])
    assert group_is_informative([0, 1]) and not group_is_informative([])


def test_grpo_advantages_hand_computed():
    adv = advantages("grpo", [1.0, 0.0, 0.0, 1.0], eps=0.0)
    np.testing.assert_allclose(adv, [1, -1, -1, 1])
    np.testing.assert_allclose(advantages("grpo", [1.0, 1.0]), [0, 0])
    np.testing.assert_allclose(advantages("mean_only", [1.0, 0.0, 0.0, 0.0]), [0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages("ppo", [1.0])


def test_clip_higher_loss_hand_computed():
    # one sequence, 4 tokens; ratios e^{0}, e^{0.5}, e^{-0.5}, and a masked one
    lp = jnp.array([[0.0, 0.5, -0.5, 3.0]])
    old = jnp.zeros((1, 4))
    mask = jnp.array([[1, 1, 1, 0]])
    ratio = np.exp([0.0, 0.5, -0.5])
    for adv in (1.0, -1.0):
        s, n, stats = clip_higher_loss(lp, old, jnp.array([adv]), mask)
        clipped = np.clip(ratio, 0.8, 1.28)
        want = np.maximum(-adv * ratio, -adv * clipped).sum()
        assert float(n) == 3 and float(s) == pytest.approx(want, rel=1e-6)
    # positive advantage: ratio 1.65 is clipped at 1.28 (clip-higher) -> one clipped token
    _, _, stats = clip_higher_loss(lp, old, jnp.array([1.0]), mask)
    assert float(stats["clip_fraction_sum"]) == 1
    # dual clip caps the loss of negative advantages at -A * c
    s, _, _ = clip_higher_loss(jnp.array([[2.0]]), jnp.zeros((1, 1)), jnp.array([-1.0]), jnp.ones((1, 1)), dual_clip=3.0)
    assert float(s) == pytest.approx(3.0)


def test_kl_penalty_is_zero_on_equal_policies_and_positive_otherwise():
    lp = jnp.array([[-1.0, -2.0]])
    assert float(kl_penalty(lp, lp, jnp.ones((1, 2)))) == 0
    assert float(kl_penalty(lp, lp + 0.3, jnp.ones((1, 2)))) > 0
