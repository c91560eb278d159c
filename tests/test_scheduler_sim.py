"""The scheduler simulation's RL pipeline (experiments/benchmarks/scheduler_sim.py): the
synchronous schedule is rollouts + update + sync per step, and the asynchronous one overlaps them
without ever starting a step before the staleness bound allows."""

import dataclasses

import pytest
from hypothesis import given, strategies as st

from experiments.benchmarks.scheduler_sim import SimConfig, best_split, limiter, simulate

SMALL = SimConfig(engines=4, rollouts_per_engine=8, reserve_new_tokens=1024)


def test_synchronous_steps_are_rollouts_then_update_then_sync():
    steps = 3
    r = simulate(SMALL, "kv_aware", seed=0, steps=steps, max_staleness=0)
    # files sync: the learner's export, then every engine's reload pause, on the critical path
    assert r["step_s"] == pytest.approx(r["rollout_s"] + r["learner_s"] + SMALL.export_s + SMALL.sync_s, rel=1e-9)
    colocated = dataclasses.replace(SMALL, sync="colocated")
    c = simulate(colocated, "kv_aware", seed=0, steps=steps, max_staleness=0)
    assert c["step_s"] == pytest.approx(c["rollout_s"] + c["learner_s"] + colocated.colocated_sync_s, rel=1e-9)


def test_the_learner_trains_the_kept_rollouts_and_sync_costs_follow_the_measured_rates():
    assert SMALL.learner_s(1000) == pytest.approx(dataclasses.replace(SMALL, kept_fraction=1.0).learner_s(500))
    # 14.77B parameters in bf16 at the measured 0.49 GB/s export and 0.85 GB/s reload
    assert SMALL.export_s == pytest.approx(2 * 14.77 / 0.49) and SMALL.sync_s == pytest.approx(2 * 14.77 / 0.85)
    assert dataclasses.replace(SMALL, sync="broadcast").export_s == 0.0


def test_prefixes_are_evicted_under_kv_pressure():
    roomy = simulate(dataclasses.replace(SMALL, affinity=True), "kv_aware", seed=3)
    tight = simulate(dataclasses.replace(SMALL, affinity=True, kv_capacity_tokens=12_000), "kv_aware", seed=3)
    assert roomy["evicted_prefixes"] == 0 < tight["evicted_prefixes"]
    assert tight["prefill_tokens"] > roomy["prefill_tokens"]  # an evicted prefix is prefilled again


def test_one_step_without_a_learner_is_the_rollout_makespan():
    r = simulate(SMALL, "kv_aware", seed=0)
    assert r["step_s"] == r["makespan_s"] and r["learner_s"] > 0


@pytest.mark.parametrize("k", [1, 2])
def test_asynchronous_steps_overlap_and_are_faster(k):
    sync = simulate(SMALL, "kv_aware", seed=1, steps=5, max_staleness=0)
    async_ = simulate(SMALL, "kv_aware", seed=1, steps=5, max_staleness=k)
    assert async_["step_s"] < sync["step_s"]
    # a step's rollouts run longer while they share the engines with the next steps'
    assert async_["rollout_s"] > sync["rollout_s"]


def test_a_sync_during_rollouts_costs_prefix_recomputation():
    cfg = dataclasses.replace(SMALL, affinity=True)
    sync = simulate(cfg, "kv_aware", seed=2, steps=4, max_staleness=0)
    async_ = simulate(cfg, "kv_aware", seed=2, steps=4, max_staleness=1)
    assert async_["prefill_tokens"] > sync["prefill_tokens"]  # caches reset under trajectories between turns


def test_a_streamed_sync_pauses_engines_after_the_first_bucket_for_the_measured_factor_of_a_reload():
    """The bucketed files sync as built: the learner writes the export at the measured 1.6 GB/s;
    the engines keep generating until the first bucket is written, then pause 1.11x a reload."""
    streamed = dataclasses.replace(SMALL, sync="streamed")
    gb = 2 * 14.77
    assert streamed.export_s == pytest.approx(gb / 1.6)
    assert streamed.pause_after_s == pytest.approx(streamed.export_s * 4.0 / gb)
    assert streamed.sync_s == pytest.approx(1.11 * gb / 0.85)
    r = simulate(streamed, "kv_aware", seed=0, steps=3, max_staleness=0)
    tail = max(streamed.export_s, streamed.pause_after_s + streamed.sync_s)  # the next step waits for both
    assert r["step_s"] == pytest.approx(r["rollout_s"] + r["learner_s"] + tail, rel=1e-9)


def test_a_staged_sync_lets_engines_generate_through_the_export_then_pauses_them_for_a_reload():
    """rollout.vllm.reload=staged as built: the export at the same rate, the engines generating
    until it is whole, then paused 1.03x a reload (measured on 2 CPU servers, 2026-11-28)."""
    staged = dataclasses.replace(SMALL, sync="staged")
    gb = 2 * 14.77
    assert staged.export_s == pytest.approx(gb / 1.6)
    assert staged.pause_after_s == pytest.approx(staged.export_s)
    assert staged.sync_s == pytest.approx(1.03 * gb / 0.85)
    r = simulate(staged, "kv_aware", seed=0, steps=3, max_staleness=0)
    assert r["step_s"] == pytest.approx(r["rollout_s"] + r["learner_s"] + staged.export_s + staged.sync_s, rel=1e-9)


def test_carry_trains_a_step_on_its_quota_of_groups_and_every_carried_group_once_in_the_next():
    wait = simulate(SMALL, "kv_aware", seed=4, steps=4, max_staleness=1)
    carry = simulate(dataclasses.replace(SMALL, carry_fraction=0.75, group_size=4), "kv_aware", seed=4, steps=4,
                     max_staleness=1)
    assert wait["carried_groups"] == 0 and carry["carried_groups"] > 0
    # the stragglers no longer hold a step's update: its rollout phase ends sooner
    assert carry["rollout_s"] < wait["rollout_s"]
    # every rollout trained once: what a step leaves behind, the next trains (the last step's
    # carried groups have no next step in a 4-step run)
    rollouts = 4 * SMALL.step_rollouts
    assert wait["trained_rollouts"] == rollouts
    assert carry["trained_rollouts"] + 4 * carry["carried_past_end"] == rollouts


def test_a_reshard_with_an_in_flight_swap_keeps_prefixes_and_lands_after_the_copy():
    """sync=reshard (issue 70): the copy at the assumed 50 GB/s while the engines generate, then a
    50 ms swap that keeps every prefix: a sync during rollouts recomputes none (unlike the reloads,
    test_a_sync_during_rollouts_costs_prefix_recomputation), and a synchronous step waits for the
    copy and the swap alone."""
    reshard = dataclasses.replace(SMALL, affinity=True, sync="reshard")
    gb = 2 * 14.77
    assert reshard.pause_after_s == reshard.export_s == pytest.approx(gb / 50.0) and reshard.sync_s == 0.05
    sync = simulate(reshard, "kv_aware", seed=2, steps=4, max_staleness=0)
    async_ = simulate(reshard, "kv_aware", seed=2, steps=4, max_staleness=1)
    assert async_["prefill_tokens"] == sync["prefill_tokens"]
    assert sync["step_s"] == pytest.approx(sync["rollout_s"] + sync["learner_s"] + reshard.pause_after_s + 0.05,
                                           rel=1e-9)


def test_the_learner_costs_6_x_params_a_token_in_one_pass_and_8_with_a_separate_old_log_prob_pass():
    """Issue 81: forward 2 + backward 4 x params FLOPs a token; the separate pass adds a forward
    (2); LoRA's backward forms no weight gradients of the base (2, not 4)."""
    one = SMALL.learner_s(1000)
    assert dataclasses.replace(SMALL, old_logprob_pass=True).learner_s(1000) == pytest.approx(one * 8 / 6)
    assert dataclasses.replace(SMALL, lora_rank=8).learner_s(1000) == pytest.approx(one * 4 / 6)
    assert one == pytest.approx(500 * 6 * SMALL.params / (SMALL.learner_devices * 0.4 * 989e12))


@given(gpus=st.integers(3, 200), data=st.data())
def test_best_split_finds_the_shortest_step_of_a_unimodal_cost(gpus, data):
    """The law the search relies on: on a cost that falls then rises in the split (or only one of
    the two), the search returns its minimum, from any start, and every count it tried is one
    it reports."""
    best = data.draw(st.integers(1, gpus - 1))
    start = data.draw(st.integers(1, gpus - 1))
    slope_down, slope_up = data.draw(st.floats(0.1, 10)), data.draw(st.floats(0.1, 10))
    cost = lambda n: {"steady_step_s": 100 + (slope_down * (best - n) if n < best else slope_up * (n - best))}
    found, result, tried = best_split(cost, gpus, start)
    assert found == best and result["steady_step_s"] == 100 and tried[best] == 100
    assert all(1 <= n <= gpus - 1 for n in tried) and len(tried) <= 4 * gpus.bit_length() + 4


def test_best_split_returns_the_shortest_step_it_tried_on_a_bumpy_cost():
    """The simulated step is not smooth in the split (one seed): whatever the search's path, what
    it returns is the shortest of the counts it tried, and of a move's two neighbours the shorter
    is taken. The cost: the steady steps simulated at 128 GPUs, async k=1 with carry (2026-12-07),
    joined by straight lines, where the first search returned 43 learner GPUs (59.4 s) with 45
    (59.1 s) and 48 (58.9 s) among those it had tried."""
    import numpy as np
    simulated = {1: 140.0, 6: 113.5, 8: 101.5, 10: 89.5, 14: 78.4, 22: 67.3, 38: 60.5, 42: 60.1, 43: 59.4,
                 44: 59.4, 45: 59.1, 46: 59.6, 48: 58.9, 50: 60.3, 54: 60.1, 62: 60.4, 70: 62.7, 127: 90.0}
    steps = np.interp(np.arange(128), list(simulated), list(simulated.values()))
    found, result, tried = best_split(lambda n: {"steady_step_s": float(steps[n])}, 128, 8)
    assert result["steady_step_s"] == min(tried.values()) == tried[found]
    assert found == 48


def test_the_limiter_names_the_learner_when_its_gpus_never_wait_and_the_bound_when_both_sides_wait():
    starved = dataclasses.replace(SMALL, engines=3, learner_devices=1, learner_mfu=0.01, sync="reshard")
    r = simulate(starved, "kv_aware", seed=1, steps=6, max_staleness=1)
    assert r["learner_busy_share"] > 0.9 and limiter(r) == "learner"
    roomy = dataclasses.replace(starved, learner_mfu=0.4)
    r = simulate(roomy, "kv_aware", seed=1, steps=6, max_staleness=1)
    assert r["learner_busy_share"] < 0.5 and limiter(r) in ("engines", "staleness bound")
    assert limiter({"learner_busy_share": 0.5, "idle_share": 0.3, "sync_pause_share": 0.25}) == "sync"


def test_a_measured_workload_replays_its_turns_and_tool_latencies_within_the_running_bound():
    """pipeline_check's inputs: measured trajectories, one decode step cost, at most one request
    running. Two rollouts of turns (5, 3) with a 0.5 s call between, 10 ms a step: A decodes 5
    (0.05 s), B 5 (0.10); A's call ends at 0.55, its 3 steps at 0.58; B's at 0.60, done 0.63."""
    cfg = SimConfig(engines=1, rollouts=2, measured_workload=((10, (5, 3), (0.5,)),), max_running=1,
                    step_base_s=0.01, step_per_seq_s=0.0, step_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                    tool_response_tokens=0)
    assert simulate(cfg, "kv_aware", seed=0)["makespan_s"] == pytest.approx(0.63)
    learner = dataclasses.replace(cfg, learner_s_per_token=0.001, kept_fraction=0.5)
    assert learner.learner_s(1000) == pytest.approx(0.5)
