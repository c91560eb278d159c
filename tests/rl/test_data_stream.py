"""The data stream: the draw side runs ahead, a checkpoint saves the trained side, filters."""

import asyncio
import dataclasses

from rstar2_jax.rl.config import RunConfig, StageConfig, base_config
from rstar2_jax.rl.data_stream import DataStream, next_problems, solved_ids
from rstar2_jax.rl.run_state import DataState


@dataclasses.dataclass(frozen=True)
class P:
    id: str


PROBLEMS = [P(str(i)) for i in range(20)]


def _cfg(filter_k=0, mode="offline", lag=0):
    c = base_config()
    c.rl.batch_problems, c.rl.max_staleness = 3, lag
    c.stages = [StageConfig(0, 100, 2, filter_k, mode, False).to_dict()]
    return RunConfig.from_config(c)


async def _never(stage, step):
    raise AssertionError("no pre-filter in this stage")


def test_the_trained_side_saves_the_position_of_its_own_draw_not_the_producers():
    stream = DataStream(PROBLEMS, _cfg(lag=2), DataState(), start_step=0)
    draws = [asyncio.run(stream.draw(s, _never)) for s in range(3)]  # the producer two steps ahead
    saved = stream.after_training(0, draws[0][1], set())
    assert saved.position == 3 and draws[2][1].position == 9
    # a stream resumed from that state draws step 1's problems again, as drawn the first time
    resumed = DataStream(PROBLEMS, _cfg(lag=2), saved, start_step=1)
    assert asyncio.run(resumed.draw(1, _never))[0] == draws[1][0]


def test_offline_prefilter_runs_once_per_stage_and_its_problems_are_skipped():
    calls = []

    async def prefilter(stage, step):
        calls.append((stage, step))
        return {"0", "1", "2", "3"}
    stream = DataStream(PROBLEMS, _cfg(filter_k=2), DataState(), 0)
    assert stream.prefilter_begins(0)
    drawn = [asyncio.run(stream.draw(s, prefilter)) for s in range(4)]
    assert calls == [(0, 0)] and not stream.prefilter_begins(1)
    assert not {"0", "1", "2", "3"} & {p.id for problems, _ in drawn for p in problems}
    assert stream.after_training(0, drawn[0][1], {"9"}).solved == ("0", "1", "2", "3")  # offline: the pre-filter's


def test_the_online_filter_of_step_s_uses_what_steps_up_to_s_minus_1_minus_lag_solved():
    stream = DataStream(PROBLEMS, _cfg(filter_k=2, mode="online", lag=1), DataState(), 0)
    _, d0 = asyncio.run(stream.draw(0, _never))
    stream.after_training(0, d0, {"7"})
    assert stream.skipped(1) == set() and stream.skipped(2) == {"7"}


def test_solved_ids_needs_the_first_k_rollouts_all_correct():
    rewards = [1, 1, 0, 1, 1, 1, 1, 0]
    assert solved_ids([P("a"), P("b")], rewards, 4, 2) == {"a", "b"}
    assert solved_ids([P("a"), P("b")], rewards, 4, 4) == set()
    assert next_problems(PROBLEMS, 0, 2, 0, set())[1] == 2
