"""DAPO's dynamic sampling and overlong shaping: the formulas, their laws, their config errors,
and a real tiny run that fills its steps, resumes, and traces every group it drew."""

import asyncio
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rstar2_jax.algo.reward_shaping import overlong_penalty
from rstar2_jax.rl.config import RunConfig, base_config
from rstar2_jax.rl.data_stream import DataStream
from rstar2_jax.rl.dynamic_sampling import informative_groups, next_draw
from rstar2_jax.rl.run_state import DataState
from rstar2_jax.config_types import ConfigValueError
from tests.rl.test_data_stream import PROBLEMS, _cfg
from tests.rl.test_training import small_config


def test_overlong_penalty_is_dapo_eq_13():
    """DAPO (arXiv 2503.14476) eq. 13 with L_max = 100, L_cache = 20: 0 up to 80, linear to -1 at 100, -1 past."""
    got = overlong_penalty([10, 80, 81, 90, 100, 101, 500], 100, 20)
    np.testing.assert_allclose(got, [0, 0, -1 / 20, -0.5, -1, -1, -1])
    np.testing.assert_array_equal(overlong_penalty([10, 500], 100, 0), [0, 0])  # off


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=20), st.integers(2, 200), st.integers(1, 200))
def test_overlong_penalty_is_in_minus_one_zero_and_never_rewards_length(lengths, max_tokens, cache):
    cache = min(cache, max_tokens - 1) or 1
    p = overlong_penalty(sorted(lengths), max_tokens, cache)
    assert np.all((p <= 0) & (p >= -1)) and np.all(np.diff(p) <= 1e-12)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(0, 400), st.floats(0, 1))
def test_draw_rounds_stop_at_the_bound_or_when_full(wanted, extra_bound, rate):
    bound = wanted + extra_bound
    drawn, informative, rounds = wanted, int(wanted * rate), 0
    while n := next_draw(informative, drawn, wanted, bound):
        assert n > 0 and drawn + n <= bound
        drawn, informative, rounds = drawn + n, informative + int(round(n * rate)), rounds + 1
        assert rounds < 100
    assert informative >= wanted or drawn == bound


def test_informative_groups_are_those_whose_rewards_differ():
    assert informative_groups([1, 0, 0, 0, 1, 0, 1, 1], 2) == 2
    assert informative_groups([1, 1, 1, 1], 4) == 0


def test_topup_draws_come_from_their_own_stream_the_same_in_every_rerun():
    a = DataStream(PROBLEMS, _cfg(), DataState(), 0)
    b = DataStream(PROBLEMS, _cfg(), DataState(), 0)
    main, _ = asyncio.run(a.draw(0, None))
    first = a.draw_topup(0, 5)
    assert first == b.draw_topup(0, 5) and first != main[:5]
    saved = a.after_training(0, _, set())
    assert saved.topup_position == 5
    resumed = DataStream(PROBLEMS, _cfg(), saved, 1)
    assert resumed.draw_topup(1, 3) == a.draw_topup(1, 3)


@pytest.mark.parametrize("rl,problem", [
    ({"dynamic_sampling": {"enabled": True, "max_problems": 3}, "batch_problems": 4},
     "rl.dynamic_sampling.max_problems: 3 is below rl.batch_problems (4)"),
    ({"overlong": {"cache_tokens": 400}}, "rl.overlong.cache_tokens: 400 must be below stages[0].max_response_tokens"),
])
def test_impossible_sampling_settings_are_config_errors(rl, problem):
    c = base_config()
    c.update_from_flattened_dict({f"rl.{k}.{kk}" if isinstance(v, dict) else f"rl.{k}": vv
                                  for k, v in rl.items() for kk, vv in (v.items() if isinstance(v, dict) else [(k, v)])})
    with pytest.raises(ConfigValueError) as e:
        RunConfig.from_config(c)
    assert problem in str(e.value)


def _rl_lines(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl") if '"phase": "rl"' in line]


@pytest.mark.slow
def test_a_run_with_dynamic_sampling_fills_its_steps_within_the_bound_and_resumes_the_same(tmp_path):
    from rstar2_jax.rl.trainer import run
    from rstar2_jax.traces import read_traces

    def cfg(steps):
        c = small_config(steps=steps)
        c.rl.dynamic_sampling.enabled, c.rl.dynamic_sampling.max_problems = True, 6
        c.rl.overlong.cache_tokens = 40
        c.eval.before_and_after = False
        return c
    run(cfg(2), str(tmp_path / "whole"))
    run(cfg(1), str(tmp_path / "resumed"))
    run(cfg(2), str(tmp_path / "resumed"))  # extends the finished run: resumes from its step-1 checkpoint
    whole, resumed = read_traces(tmp_path / "whole" / "traces"), read_traces(tmp_path / "resumed" / "traces")
    for m in _rl_lines(tmp_path / "whole"):
        drawn = m["dynamic_sampling/problems_drawn"]
        assert 2 <= drawn <= 6 and (m["dynamic_sampling/informative_groups"] >= 2 or drawn == 6)
        step = whole[whole["step"] == m["step"]]
        assert len(step) == drawn * 4                       # every group drawn is traced, trained or not
        assert step[step["kept"]]["problem_id"].nunique() <= 2   # at most rl.batch_problems groups trained
    assert any(m["dynamic_sampling/rounds"] >= 1 for m in _rl_lines(tmp_path / "whole"))  # it did draw more
    for s in (0, 1):
        assert list(whole[whole["step"] == s]["problem_id"]) == list(resumed[resumed["step"] == s]["problem_id"])
