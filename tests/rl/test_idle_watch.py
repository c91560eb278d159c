"""A run that is not learning says so (issue 80 item 4): rl/idle_watch.py."""

import pytest

from rstar2_jax.rl.idle_watch import IdleConfig, IdleWatch, RunNotLearning


def step(kept, accuracy=0.0, formats=0.5):
    return {"kept_rollouts": kept, "accuracy": accuracy, "format_failure_rate": formats}


def test_consecutive_steps_that_train_nothing_warn_with_the_cause_then_stop():
    watch = IdleWatch(IdleConfig(warn_after=3, stop_after=5))
    said = [watch.observe(i, step(0)) for i in range(4)]
    assert said[:2] == [None, None] and said[3] is None
    assert said[2].startswith("warning: RL steps 0-2 kept no rollout and trained nothing: no rollout solved its problem")
    assert "format failures 50%" in said[2] and "sft.steps" in said[2] and "rl.idle.stop_after=5 stops the run" in said[2]
    with pytest.raises(RunNotLearning, match=r"stopped: RL steps 0-4 kept no rollout .*rl.idle.stop_after=5"):
        watch.observe(4, step(0))


def test_a_step_that_trains_resets_the_count_and_each_cause_is_named():
    watch = IdleWatch(IdleConfig(warn_after=2, stop_after=0))
    assert watch.observe(0, step(0)) is None and watch.observe(1, step(4)) is None
    assert watch.observe(2, step(0, accuracy=1.0)) is None
    said = watch.observe(3, step(0, accuracy=1.0))
    assert "RL steps 2-3" in said and "accuracy 100%" in said and "filter_solved_k" in said
    assert "rl.idle.stop_after=N stops a run" in said
    assert watch.observe(4, step(0, accuracy=0.5)) is None  # every warn_after steps, not every step
    said = watch.observe(5, step(0, accuracy=0.5))
    assert "RL steps 2-5" in said and "scored alike (accuracy 50%)" in said and "rl.group_size" in said
    quiet = IdleWatch(IdleConfig(warn_after=0, stop_after=0))
    assert all(quiet.observe(i, step(0)) is None for i in range(10))
