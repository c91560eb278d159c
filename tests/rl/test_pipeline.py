"""The staleness-gated producer/consumer loop with fake steps, the run state's checkpoint form,
and the data stream's two sides: no trainer, model or engine involved."""

import asyncio
import dataclasses
import json

import pytest

from rstar2_jax.core import processes
from rstar2_jax.rl.pipeline import run_pipeline, token_staleness
from rstar2_jax.rl.run_state import CarriedGroups, DataState, RunState, RunStateError


def _run(steps, lag, *, rollout_s=0.01, consume_s=0.02, exclusive=lambda s: False, fail_draw=None,
         fail_consume=None, collective_in=None):
    """Runs fake steps; returns the event log: ("draw", s, consumed_so_far), ("consume", s)."""
    log, consumed = [], []

    async def draw(step):
        if step == fail_draw:
            raise ValueError(f"draw {step} failed")
        if collective_in == "draw":
            processes.barrier("in a draw")
        log.append(("draw", step, len(consumed)))

        async def rollouts():
            if collective_in == "rollouts":
                processes.gather_shares([step], 1)
            await asyncio.sleep(rollout_s)
            return f"data{step}"
        return rollouts()

    async def consume(step, data):
        assert data == f"data{step}"
        processes.barrier("the consumer may")  # collectives are the consumer's
        await asyncio.sleep(consume_s)
        if step == fail_consume:
            raise KeyError(f"consume {step} failed")
        consumed.append(step)
        log.append(("consume", step))

    asyncio.run(run_pipeline(steps, max_lag=lag, draw=draw, consume=consume, exclusive=exclusive))
    return log


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_steps_are_consumed_in_order_and_drawn_at_most_lag_steps_ahead(lag):
    log = _run(range(3, 10), lag)
    assert [e[1] for e in log if e[0] == "consume"] == list(range(3, 10))
    assert [e[1] for e in log if e[0] == "draw"] == list(range(3, 10))
    for _, step, consumed in (e for e in log if e[0] == "draw"):
        # step s starts only once steps up to s - 1 - lag are trained (counted from the first step)
        assert consumed >= step - 3 - lag
    if lag:  # and it does run ahead when it may
        assert any(consumed < step - 3 for _, step, consumed in (e for e in log if e[0] == "draw"))


def test_an_exclusive_step_waits_for_every_earlier_step_and_may_gather():
    log = _run(range(0, 6), 2, exclusive=lambda s: s == 4, collective_in=None)
    draw4 = next(e for e in log if e[:2] == ("draw", 4))
    assert draw4[2] == 4


def test_a_collective_in_the_producer_raises_instead_of_deadlocking():
    with pytest.raises(processes.CollectiveInProducerError, match="the rollout producer"):
        _run(range(0, 3), 1, collective_in="draw")
    with pytest.raises(processes.CollectiveInProducerError, match="gather_shares called in the rollout producer"):
        _run(range(0, 3), 1, collective_in="rollouts")
    _run(range(0, 3), 1, collective_in="draw", exclusive=lambda s: True)  # exclusive draws may


def test_errors_from_either_side_end_the_loop_without_hanging():
    with pytest.raises(ValueError, match="draw 2 failed"):
        _run(range(0, 5), 1, fail_draw=2)
    with pytest.raises(KeyError, match="consume 1 failed"):
        _run(range(0, 5), 2, fail_consume=1)


def test_token_staleness_measures_lags_and_refuses_past_the_bound():
    m = token_staleness([[3, 3, -1], [2]], [[2, 3, -1], [2]], learner_version=3, bound=1, step=5)
    assert m == {"staleness/max": 1.0, "staleness/mean": pytest.approx(1 / 3), "staleness/kv_max": 1.0,
                 "staleness/over_bound_tokens": 0.0}
    with pytest.raises(RuntimeError, match="step 5: a token sampled 2 versions ago"):
        token_staleness([[1]], [[1]], learner_version=3, bound=1, step=5)
    # a carried group may lag one version more: kept, and counted past the bound
    m = token_staleness([[1, 2, 3]], [[1, 2, 3]], learner_version=3, bound=1, step=5, carried=1)
    assert m["staleness/max"] == 2.0 and m["staleness/over_bound_tokens"] == 1.0
    with pytest.raises(RuntimeError, match=r"exceeds rl.max_staleness=1 \+ 1"):
        token_staleness([[0]], [[0]], learner_version=3, bound=1, step=5, carried=1)


def test_run_state_round_trips_and_reads_what_earlier_runs_wrote():
    state = RunState(rl_step=7, version=7, stage=1, results={"before": {"greedy": {}}},
                     data=DataState(position=112, solved=("a", "b"), prefiltered_stage=1))
    assert RunState.from_json(state.to_json()) == state
    carrying = dataclasses.replace(state, carried=CarriedGroups(step=6, problem_ids=("p1", "p2", "p3"), groups=(0, 2)))
    assert RunState.from_json(json.loads(json.dumps(carrying.to_json()))) == carrying
    # an earlier run's checkpoint before any filter ran had no solved / prefiltered_stage
    old = {"rl_step": 4, "data_pos": 64, "version": 4, "stage": 0, "results": {}}
    assert RunState.from_json(old) == RunState(rl_step=4, version=4, data=DataState(position=64))


@pytest.mark.parametrize("raw,problem", [
    ({"rl_step": 1, "version": 1, "stage": 0, "results": {}}, "missing keys ['data_pos']"),
    ({"rl_step": 1, "version": 1, "stage": 0, "results": {}, "data_pos": 0, "epoch": 3}, "unknown keys ['epoch']"),
    ({"rl_step": "1", "version": 1, "stage": 0, "results": {}, "data_pos": 0}, "rl_step = '1' is not int"),
])
def test_a_run_state_this_code_cannot_read_is_refused_naming_the_keys(raw, problem):
    with pytest.raises(RunStateError) as e:
        RunState.from_json(raw, "ckpt step 4")
    assert "cannot resume from ckpt step 4" in str(e.value) and problem in str(e.value)


@pytest.mark.parametrize("lag", [1, 2])
def test_long_rollouts_are_trained_at_the_rate_of_short_ones_and_no_group_is_lost(lag):
    """Staleness without length bias: each step draws short and long groups (the long ones take
    up to 25x as long); the bound holds by pausing admission (step s starts after s-1-k is
    trained) and every step trains only when all its groups are in, so every drawn group is
    trained exactly once, long and short alike. The tolerance is zero: the pipeline never drops
    or expires a group (frameworks that drop expired groups train long ones less)."""
    import random
    rng = random.Random(lag)
    drawn, trained, version, lags = [], [], [0], []

    async def draw(step):
        groups = [(step, i, "long" if i % 2 else "short") for i in range(4)]
        drawn.extend(groups)
        started_at = version[0]

        async def one(group):
            await asyncio.sleep(rng.uniform(0.02, 0.05) if group[2] == "long" else 0.002)
            return group, started_at

        async def rollouts():
            return await asyncio.gather(*(one(g) for g in groups))
        return rollouts()

    async def consume(step, data):
        await asyncio.sleep(0.005)
        for group, started_at in data:
            trained.append(group)
            lags.append(version[0] - started_at)
        version[0] += 1

    asyncio.run(run_pipeline(range(12), max_lag=lag, draw=draw, consume=consume))
    assert sorted(trained) == sorted(drawn) and len(trained) == len(set(trained)) == 48
    rate = {kind: sum(g[2] == kind for g in trained) / sum(g[2] == kind for g in drawn) for kind in ("short", "long")}
    assert rate == {"short": 1.0, "long": 1.0}
    assert max(lags) <= lag and max(lags) == lag  # the bound is used, never passed


def test_a_cut_takes_the_complete_groups_and_the_carried_ones_are_waited_for_whole():
    """rl/carry.py with rollouts finished by hand: the step is cut once `want` groups are
    complete (every rollout of the group done), the results come problem-major, and a group
    with one rollout still running is not complete."""
    from rstar2_jax.rl.carry import RunningGroups, StalenessConfig, gather_groups, wait_for_groups

    async def main():
        loop = asyncio.get_running_loop()
        futures = {i: loop.create_future() for i in range(6)}  # 3 groups x 2 rollouts
        running = RunningGroups(step=4, problems=["a", "b", "c"], groups=[0, 1, 2], tasks=futures)
        for i in (2, 3, 4):  # group 1 complete, group 2 half done
            futures[i].set_result(f"r{i}")
        cut = await wait_for_groups(running, n_roll=2, want=1, poll_s=0.001)
        assert cut == [1] and gather_groups(running, cut, 2) == ["r2", "r3"]
        waiting = asyncio.ensure_future(wait_for_groups(running, n_roll=2, want=3, poll_s=0.001))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        for i in (0, 1, 5):
            futures[i].set_result(f"r{i}")
        assert await waiting == [0, 1, 2]
        assert gather_groups(running, [2, 0], 2) == ["r4", "r5", "r0", "r1"]

    asyncio.run(main())
    policy = StalenessConfig(policy="carry", carry_fraction=0.25)
    assert policy.wanted(4) == 1 and policy.wanted(10) == 3 and StalenessConfig().wanted(10) == 10
