"""The trainer on the embedded engine with paged KV: a quarter of the memory, the same training."""

import asyncio

import numpy as np
import pytest

from rstar2_jax.core.config_types import ConfigValueError
from rstar2_jax.rl.config import validate
from rstar2_jax.rl.trainer import RLRun
from rstar2_jax.traces import read_traces
from tests.rl.test_async import moving_advantage, moving_config, params_of  # noqa: F401 - a fixture
from tests.rl.test_training import COMPARED, rl_lines, small_config


@pytest.mark.slow
def test_paged_kv_at_a_quarter_of_the_memory_trains_on_the_same_rollouts(tmp_path, moving_advantage):  # noqa: F811
    rows_cfg = moving_config(steps=2, max_staleness=0)
    paged_cfg = moving_config(steps=2, max_staleness=0)
    r, j = paged_cfg.rollout, paged_cfg.rollout.jax
    j.page_size = 16
    j.kv_pages = j.slots * r.max_len // j.page_size // 4  # 8 slots over 2 rows' memory: requests get preempted
    runs = {}
    for name, cfg in (("rows", rows_cfg), ("paged", paged_cfg)):
        runs[name] = RLRun(cfg, str(tmp_path / name))
        asyncio.run(runs[name].run())
    rows, paged = (read_traces(tmp_path / name / "traces") for name in ("rows", "paged"))
    key = ["step", "problem_id", "sample_index"]
    rows, paged = rows.sort_values(key).reset_index(drop=True), paged.sort_values(key).reset_index(drop=True)
    assert len(rows) == len(paged) > 0
    assert [list(t) for t in rows["token_ids"]] == [list(t) for t in paged["token_ids"]]
    for la, lb in zip(rl_lines(tmp_path / "rows"), rl_lines(tmp_path / "paged")):
        for k in COMPARED:
            if k in la:
                assert la[k] == pytest.approx(lb[k], rel=1e-5, abs=1e-6), (la["step"], k)
        # a preempted request's recomputation is the only prefill the rows did not do
        if lb["engine/preemptions"] == 0:
            assert lb["engine/prefill_tokens"] == la["engine/prefill_tokens"]
        else:
            assert lb["engine/prefill_tokens"] > la["engine/prefill_tokens"]
    assert sum(l["engine/preemptions"] for l in rl_lines(tmp_path / "paged")) > 0
    for a, b in zip(params_of(runs["rows"]), params_of(runs["paged"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_paged_kv_settings_are_checked():
    cfg = small_config()
    cfg.rollout.jax.page_size = 48  # does not divide 256
    cfg.rollout.jax.kv_pages = 2
    with pytest.raises(ConfigValueError) as e:
        validate(cfg)
    assert "rollout.jax.page_size: 48 must divide rollout.max_len=256" in str(e.value)
    assert "rollout.jax.kv_pages: 2 x page_size=48 cannot hold one max_len=256 sequence" in str(e.value)
    cfg = small_config()
    cfg.rollout.jax.kv_pages = 64
    with pytest.raises(ConfigValueError, match="rollout.jax.kv_pages: needs rollout.jax.page_size > 0"):
        validate(cfg)
    cfg = small_config()
    cfg.rollout.jax.page_size, cfg.rollout.engine, cfg.rollout.vllm.urls = 16, "vllm", ("http://127.0.0.1:1",)
    # the embedded engine's paging is not vLLM's (its servers page their own): kept unread, said at start
    assert "rollout.jax.page_size is set but unread: rollout.engine is 'vllm'" in validate(cfg).warnings()
