"""RoC selection statistics and advantages against hand-computed values (losses: test_losses.py)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rstar2_jax.algo import advantages, group_is_informative, roc_select
from rstar2_jax.algo.roc import (PaperSelection, ReleaseSelection, paper_selection, release_selection,
                                 uniform_selection)
from rstar2_jax.algo.advantages import AdvantageConfig, GRPOAdvantageSettings

SELECTIONS = {"paper": paper_selection, "uniform": uniform_selection, "release": release_selection}
groups = st.integers(2, 32).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n),
    st.lists(st.floats(0, 2), min_size=n, max_size=n),
    st.integers(1, n), st.integers(0, 2**31 - 1)))


@settings(max_examples=300, deadline=None)
@given(groups, st.sampled_from(["paper", "uniform", "release"]))
def test_selection_counts(group, mode):
    rewards, penalties, keep, seed = group
    idx = roc_select(rewards, penalties, keep, np.random.default_rng(seed), SELECTIONS[mode])
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
        want_neg = neg * keep // n  # floor: the paper keeps half the negatives, rounded down, at 2G -> G
        want_neg = keep - min(keep - want_neg, pos)
        assert int((r[idx] <= 0).sum()) == want_neg


@pytest.mark.parametrize("two_g", [8, 32])
def test_paper_counts_for_every_split_of_2g(two_g):
    """The paper's split at 2G -> G for every (positives, negatives): floor(neg / 2) negatives,
    the rest of G positives (so ceil(pos / 2) of them: a single success is kept)."""
    g = two_g // 2
    for n_pos in range(two_g + 1):
        n_neg = two_g - n_pos
        rewards = [1.0] * n_pos + [0.0] * n_neg
        for seed in range(3):
            idx = roc_select(rewards, np.zeros(two_g), g, np.random.default_rng(seed), paper_selection)
            kept_pos = int((np.asarray(rewards)[idx] > 0).sum())
            kept_neg = len(idx) - kept_pos
            assert len(idx) == g
            if n_pos == 0:
                assert kept_neg == g
            else:
                assert kept_neg == n_neg // 2 and kept_pos == g - n_neg // 2 == -(-n_pos // 2), (n_pos, n_neg)
        if n_pos == 1:
            assert kept_pos == 1  # the rare success on a hard problem is trained on


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
        counts[roc_select(rewards, penalties, 2, np.random.default_rng(seed), paper_selection,
                          PaperSelection(eps=eps))] += 1
    w = 1 / (penalties[:3] + eps)
    np.testing.assert_allclose(counts[:3] / trials, w / w.sum(), atol=0.02)


def released_roc_choices(rewards, penalty_weights, down_sample_to_n, min_zero, min_non_zero):
    """microsoft/rStar rstar2_agent/down_sample/roc.py (commit 5e95b19, "rm sort for negative
    samples (#50)"), the per-uid body of resample_of_correct, ported line by line with torch and
    DataProto taken out. Returns the kept indices, or None where the released code asserts."""
    indices = np.arange(len(rewards))
    if len(indices) < down_sample_to_n:
        return []  # "Not enough samples for this uid, skip": nothing of the group is kept
    if len(indices) == down_sample_to_n:
        return list(indices)
    zero_reward_pairs = [(i, w) for i, r, w in zip(indices, rewards, penalty_weights) if r <= 0]
    non_zero_reward_pairs = [(i, w) for i, r, w in zip(indices, rewards, penalty_weights) if r > 0]
    non_zero_reward_pairs.sort(key=lambda x: x[1])
    zero_reward_trace_num = round(len(zero_reward_pairs) * down_sample_to_n / len(indices))
    non_zero_reward_trace_num = round(len(non_zero_reward_pairs) * down_sample_to_n / len(indices))
    if zero_reward_trace_num < min_zero and non_zero_reward_trace_num < min_non_zero:
        return list(indices)
    if zero_reward_trace_num <= min(min_zero, len(zero_reward_pairs)):
        zero_reward_trace_num = min(min_zero, len(zero_reward_pairs))
        non_zero_reward_trace_num = down_sample_to_n - zero_reward_trace_num
    if non_zero_reward_trace_num <= min(min_non_zero, len(non_zero_reward_pairs)):
        non_zero_reward_trace_num = min(min_non_zero, len(non_zero_reward_pairs))
        zero_reward_trace_num = down_sample_to_n - non_zero_reward_trace_num
    choices = [p[0] for p in non_zero_reward_pairs[:non_zero_reward_trace_num]] \
        + [p[0] for p in zero_reward_pairs[:zero_reward_trace_num]]
    if len(choices) != down_sample_to_n:
        return None  # the released code's assert
    return choices


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([4, 8, 16, 32]).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n),
    st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]), min_size=n, max_size=n),
    st.integers(0, 3), st.integers(0, 3))))
def test_release_mode_is_the_released_code_case_by_case(case):
    rewards, penalties, min_neg, min_pos = case
    keep = len(rewards) // 2  # 2G -> G, as the release runs it
    want = released_roc_choices(rewards, penalties, keep, min_neg, min_pos)
    got = roc_select(rewards, penalties, keep, np.random.default_rng(0), release_selection,
                     ReleaseSelection(min_neg=min_neg, min_pos=min_pos))
    if want is not None:
        assert got.tolist() == sorted(int(i) for i in want)


def test_release_mode_takes_negatives_in_rollout_order_and_positives_by_penalty():
    rewards = np.array([1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1])  # 10 pos, 6 neg
    penalties = np.arange(16)[::-1] / 16  # later rollouts cleaner
    a = roc_select(rewards, penalties, 8, np.random.default_rng(0), release_selection)
    b = roc_select(rewards, penalties, 8, np.random.default_rng(1), release_selection)
    np.testing.assert_array_equal(a, b)  # deterministic
    pos = sorted(np.flatnonzero(rewards > 0), key=lambda i: penalties[i])[:round(10 * 8 / 16)]
    neg = list(np.flatnonzero(rewards <= 0))[:round(6 * 8 / 16)]  # not sorted since #50
    np.testing.assert_array_equal(a, sorted(pos + neg))
    # one positive in 16: proportional count 0 < min 2 -> the minimum (1 available) is taken
    r2 = np.array([1] + [0] * 15)
    idx = roc_select(r2, np.zeros(16), 8, np.random.default_rng(0), release_selection)
    assert len(idx) == 8 and 0 in idx


def test_uniform_selection_is_uniform():
    counts = np.zeros(8)
    for seed in range(4000):
        counts[roc_select([1, 1, 1, 1, 0, 0, 0, 0], np.arange(8.0), 4, np.random.default_rng(seed), uniform_selection)] += 1
    np.testing.assert_allclose(counts / 4000, 0.5, atol=0.04)


def test_bad_mode_and_shapes():
    from rstar2_jax.rl.roc_modes import ROC_MODES
    with pytest.raises(ValueError, match="unknown RoC mode 'best'; registered: off, paper, release"):
        ROC_MODES["best"]  # noqa: B018  (the one registry of RoC: modes, each with its selection)
    with pytest.raises(ValueError, match="differ in shape"):
        roc_select([1, 0], [0], 1, np.random.default_rng(0))


def test_group_is_informative():
    assert not group_is_informative([1, 1, 1]) and not group_is_informative([0, 0])
    assert group_is_informative([0, 1]) and not group_is_informative([])


def test_grpo_advantages_hand_computed():
    no_eps = AdvantageConfig(name="grpo", grpo=GRPOAdvantageSettings(eps=0.0))
    adv = advantages(no_eps, [1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(adv, [1, -1, -1, 1])
    np.testing.assert_allclose(advantages("grpo", [1.0, 1.0]), [0, 0])
    np.testing.assert_allclose(advantages("mean_only", [1.0, 0.0, 0.0, 0.0]), [0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages("ppo", [1.0])


def test_kl_in_the_reward_lowers_each_reward_before_the_group_advantage():
    """verl use_kl_in_reward with an outcome reward: score - coef x sum_t kl_t, then the group advantage."""
    from types import SimpleNamespace

    from rstar2_jax.rl.grpo_roc import advantages_with_kl
    kept = [SimpleNamespace(group=g, reward=r) for g, r in ((0, 1.0), (0, 0.0), (1, 1.0), (1, 0.0), (1, 0.0))]
    kl = np.array([2.0, 0.0, 1.0, 1.0, 3.0])
    got = advantages_with_kl(kept, kl, 0.1, "mean_only")
    np.testing.assert_allclose(got[:2], [0.4, -0.4], rtol=1e-5)
    np.testing.assert_allclose(got[2:], np.array([0.9, -0.1, -0.3]) - np.mean([0.9, -0.1, -0.3]), rtol=1e-5)
    np.testing.assert_allclose(advantages_with_kl(kept, np.zeros(5), 0.1, "grpo"),
                               np.concatenate([advantages("grpo", [1, 0]), advantages("grpo", [1, 0, 0])]))
