"""Asynchronous rollouts (rl.max_staleness): the on-policy setting trains exactly as the plain
sequential loop, async runs never train on a token more than k versions old, record the version
of every token, and checkpoint the data stream as of the last trained step (not the producer's
look-ahead)."""

import asyncio

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rstar2_jax.algo.advantages import ADVANTAGES, AdvantageSpec
from rstar2_jax.data.tasks import make_task
from rstar2_jax.core.checkpoints import RunCheckpoints
from rstar2_jax.rl.data_stream import next_problems
from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.rl.config import validate
from rstar2_jax.rl.trainer import RLRun, run
from rstar2_jax.traces import read_traces
from tests.rl.test_training import rl_lines, small_config


def alternating_signs(rewards, settings) -> np.ndarray:
    """+1, -1, +1, ... whatever the rewards: the barely trained tiny policy solves nothing, and
    these tests need updates that move the weights (GRPO gives all-zero advantages then)."""
    del settings
    return np.where(np.arange(len(rewards)) % 2 == 0, 1.0, -1.0).astype(np.float32)


@pytest.fixture
def moving_advantage(monkeypatch):
    """Registered for the test only: other tests list the registry in their messages."""
    monkeypatch.setitem(ADVANTAGES, "test_alternating_signs", AdvantageSpec(alternating_signs))


def moving_config(steps: int, max_staleness: int):
    cfg = small_config(steps=steps, max_staleness=max_staleness)
    cfg.rl.advantage.name = "test_alternating_signs"
    cfg.rl.roc.reject_uniform_groups = False
    cfg.eval.before_and_after = False
    return cfg


def params_of(rl_run: RLRun) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(rl_run.learner.model_state())]


def test_negative_staleness_is_a_config_error():
    with pytest.raises(ConfigValueError, match="rl.max_staleness: must be >= 0"):
        validate(small_config(max_staleness=-1))


@pytest.mark.slow
def test_staleness_zero_without_correction_updates_exactly_as_the_sequential_loop(tmp_path, moving_advantage):
    cfg = moving_config(steps=2, max_staleness=0)
    assert cfg.rl.correction.names == ()
    pipelined = RLRun(cfg, str(tmp_path / "pipelined"))
    asyncio.run(pipelined.run())

    # the loop as it was before the pipeline: generate a step, train on it, next step
    sequential = RLRun(cfg, str(tmp_path / "sequential"))

    async def loop():
        async with sequential.session():
            start = params_of(sequential)
            for step in range(cfg.rl.steps):
                out = await sequential.producer.step_rollouts(step, *await sequential.draw(step))
                await sequential.consume(step, out)
            return start

    start = asyncio.run(loop())
    a, b = params_of(pipelined), params_of(sequential)
    assert pipelined.learner.version == sequential.learner.version == 2
    assert any(not np.array_equal(x, y) for x, y in zip(start, b))  # the updates moved the weights
    assert all(np.array_equal(x, y) for x, y in zip(a, b))          # bit for bit
    assert all(l["staleness/max"] == 0 for l in rl_lines(tmp_path / "pipelined"))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_async_rollouts_lag_at_most_k_versions_and_checkpoint_the_trained_data_position(tmp_path, k,
                                                                                       moving_advantage):
    cfg = moving_config(steps=4, max_staleness=k)
    run(cfg, str(tmp_path))
    lines = rl_lines(tmp_path)
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    assert all(0 <= l["staleness/max"] <= k and 0 <= l["staleness/kv_max"] <= k for l in lines)
    assert max(l["staleness/max"] for l in lines) >= 1  # later steps' rollouts ran during updates

    traces = read_traces(tmp_path / "traces")
    for _, r in traces.iterrows():
        versions, mask = np.asarray(r["versions"]), np.asarray(r["loss_mask"])
        kv_versions = np.asarray(r["kv_versions"])
        assert len(versions) == len(kv_versions) == len(r["token_ids"])
        assert (versions[mask == 0] == -1).all() and (versions[mask == 1] >= 0).all()
        assert (kv_versions[mask == 0] == -1).all() and (0 <= kv_versions[mask == 1]).all()
        assert (kv_versions <= versions).all() and (kv_versions[mask == 1] >= r["step"] - k).all()
        assert r["policy_version"] == versions[mask == 1].min()
        assert r["step"] - k <= r["policy_version"] <= r["step"]  # versions count updates, one per step here

    # the data stream a checkpoint saved is where the trained steps left it, although the
    # producer had drawn later steps' problems by then
    problems = make_task(cfg.data, cfg.seed).train_problems
    ckpts = RunCheckpoints(str(tmp_path / "checkpoints"), keep=cfg.checkpoint.keep)
    saved = set(ckpts.manager.all_steps())
    pos, ids = 0, []
    for step in range(cfg.rl.steps):
        batch, pos = next_problems(problems, pos, cfg.rl.batch_problems, cfg.seed, set())
        ids.append(sorted(p.id for p in batch))
        if step + 1 in saved:
            meta = ckpts.manager.restore(step + 1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            assert (meta["data_pos"], meta["rl_step"]) == (pos, step + 1)
    ckpts.close()
    assert len(saved) >= 2
    for step in range(cfg.rl.steps):
        assert sorted(traces[traces["step"] == step]["problem_id"].unique()) == ids[step]

    # and the run resumes from its last checkpoint
    more = moving_config(steps=5, max_staleness=k)
    run(more, str(tmp_path))
    assert [l["step"] for l in rl_lines(tmp_path)] == [0, 1, 2, 3, 4]


class Crash(Exception):
    """The run dies right after a checkpoint (as a SIGKILL would, minus the process)."""


@pytest.mark.slow
def test_carry_trains_every_group_once_long_and_short_alike_and_resumes_carried_groups(tmp_path, moving_advantage,
                                                                                       monkeypatch):
    """rl.staleness.policy=carry at k = 1: a step trains once a quarter of its groups are in and
    carries the rest into the next step; the run dies after a checkpoint that records carried
    groups and resumes. Every drawn group is trained exactly once, the long ones (the carried
    ones, above the median length) as often as the short ones (tolerance 0: nothing is ever
    dropped), and no token lags more than k + 1 versions."""
    cfg = moving_config(steps=4, max_staleness=1)
    cfg.rl.batch_problems = 4
    cfg.rl.staleness.policy, cfg.rl.staleness.carry_fraction = "carry", 0.25
    cfg.rl.correction.names = ("token_tis",)
    save = RLRun.save_checkpoint

    def crash_after_step_one(self, step):
        save(self, step)
        if step == 1:
            raise Crash()

    monkeypatch.setattr(RLRun, "save_checkpoint", crash_after_step_one)
    with pytest.raises(Crash):
        asyncio.run(RLRun(cfg, str(tmp_path)).run())
    monkeypatch.setattr(RLRun, "save_checkpoint", save)
    ckpts = RunCheckpoints(str(tmp_path / "checkpoints"), keep=cfg.checkpoint.keep)
    meta = ckpts.manager.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    ckpts.close()
    assert meta["carried"] is not None and meta["carried"]["step"] == 0 and meta["carried"]["groups"]
    resumed = RLRun(cfg, str(tmp_path))
    asyncio.run(resumed.run())

    lines = rl_lines(tmp_path)
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    assert sum(l["staleness/carried_out"] for l in lines) == sum(l["staleness/carried_in"] for l in lines) > 0
    assert lines[1]["staleness/carried_in"] == len(meta["carried"]["groups"])  # the resumed run trained them
    assert max(l["staleness/max"] for l in lines) <= 2
    traces = read_traces(tmp_path / "traces")
    n_roll = cfg.rl.group_size * cfg.rl.oversample
    drawn = 4 * cfg.rl.batch_problems
    assert len(traces) == drawn * n_roll and len(traces.groupby(["problem_id", "sample_index"])) == drawn * n_roll
    length = traces.groupby("problem_id")["num_response_tokens"].mean()
    long = set(length[length >= length.median()].index)
    trained = traces.groupby("problem_id").size()
    assert (trained[list(long)] == n_roll).all() and (trained.drop(list(long)) == n_roll).all()
    assert not resumed.carried
