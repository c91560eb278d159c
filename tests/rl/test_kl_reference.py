"""The KL term's frozen reference travels with the run: saved in its checkpoints, restored on
resume (not rebuilt from the current weights), and a checkpoint without one says so."""

import asyncio

import jax
import numpy as np
import pytest

from rstar2_jax.rl.trainer import RLRun
from tests.rl.test_async import moving_advantage, moving_config  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("moving_advantage")]


def _cfg(steps, coef=0.05, place="loss"):
    c = moving_config(steps, max_staleness=0)  # updates that move the weights, whatever the rewards
    c.rl.kl.coef, c.rl.kl.place = coef, place
    return c


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


async def _session_leaves(rl_run):
    async with rl_run.session():
        return _leaves(rl_run.learner.ref_params), _leaves(rl_run.learner.model_state())


def test_the_reference_is_saved_and_restored_with_the_run(tmp_path):
    first = RLRun(_cfg(2), str(tmp_path))
    asyncio.run(first.run())
    ref, params = _leaves(first.learner.ref_params), _leaves(first.learner.model_state())
    assert any(not np.array_equal(a, b) for a, b in zip(ref, params))  # the policy moved away from it
    resumed_ref, resumed_params = asyncio.run(_session_leaves(RLRun(_cfg(3), str(tmp_path))))
    assert all(np.array_equal(a, b) for a, b in zip(ref, resumed_ref))
    assert all(np.array_equal(a, b) for a, b in zip(params, resumed_params))


def test_a_kl_run_resumed_from_a_checkpoint_without_a_reference_says_so(tmp_path):
    asyncio.run(RLRun(_cfg(1, coef=0.0), str(tmp_path)).run())
    with pytest.raises(ValueError, match="holds no reference weights"):
        asyncio.run(_session_leaves(RLRun(_cfg(2), str(tmp_path), config_mismatch="ok")))


def test_kl_in_the_reward_trains_and_reports_the_sequence_kl(tmp_path):
    rl_run = RLRun(_cfg(2, place="reward"), str(tmp_path))
    asyncio.run(rl_run.run())
    import json
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if '"phase": "rl"' in l]
    trained = [m for m in lines if "optimizer_steps" in m]
    assert trained and all("kl_reward_k3" in m and "kl_ref_k3" not in m for m in trained)
