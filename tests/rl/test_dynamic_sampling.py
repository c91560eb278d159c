"""DAPO's dynamic sampling and overlong shaping: the formulas, their laws, their config errors,
and two asynchronous trainer processes that fill their steps alike, resume, and trace every group drawn."""

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
from rstar2_jax.core.config_types import ConfigValueError
from tests.rl.test_data_stream import PROBLEMS, _cfg


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
def test_two_async_processes_fill_steps_alike_without_a_producer_collective_and_resume(tmp_path):
    """Two trainer processes, rollouts one step ahead (max_staleness 1): the extra problems are
    drawn and gathered by the consumer in both, the same in each (a mismatch would fail the
    gather), the run resumes from its checkpoint, and every step's problems are what the data
    stream's two sides give on their own. The barely trained policy solves nothing, so every
    step draws to its bound (2 problems, then 4 more in one round)."""
    import asyncio as aio

    from experiments import tiny_arith
    from rstar2_jax.data.tasks import make_task
    from rstar2_jax.rl.config import validate
    from rstar2_jax.traces import read_traces
    from tests.rl.launch import launch
    from tests.rl.test_multiprocess import train_args

    overrides = ["--config.rl.dynamic_sampling.enabled=True", "--config.rl.dynamic_sampling.max_problems=6",
                 "--config.rl.max_staleness=1", "--config.rl.correction.names=('token_tis',)"]
    for steps in (2, 3):  # 2 steps, then the same run extended: resumed from its step-2 checkpoint
        args = train_args("experiments/tiny_arith.py", tmp_path, steps) + overrides
        for status, _out, err in launch(args, tmp_path / f"s{steps}", n=2):
            assert status == 0, err[-3000:]
    assert "resumed from" in open(tmp_path / "s3.p0.out").read()
    lines = _rl_lines(tmp_path)
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all(m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/problems_drawn"] == 6 for m in lines)
    traces = read_traces(tmp_path / "traces")
    assert (traces["reward"] == 0).all(), "the premise: the 4-step SFT policy solves nothing"

    c = tiny_arith.get_config()
    c.update_from_flattened_dict({"data.train_problems": 32, "data.eval_problems": 4, "rl.batch_problems": 2,
                                  "rl.group_size": 2, "rollout.max_len": 512, "rl.max_staleness": 1})
    cfg = validate(c, 1)
    stream = DataStream(make_task(cfg.data, cfg.seed).train_problems, cfg, DataState(), 0)
    for step in range(3):
        problems, drawn = aio.run(stream.draw(step, None))
        want = [p.id for p in problems + stream.draw_topup(step, 4)]
        stream.after_training(step, drawn, set())
        drawn_ids = traces[traces["step"] == step]["problem_id"]
        assert list(dict.fromkeys(drawn_ids)) == want and len(drawn_ids) == 6 * 4, step
