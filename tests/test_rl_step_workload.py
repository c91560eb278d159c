"""The whole-step benchmark's reading of a run (experiments/benchmarks/rl_step.py): the workload it
hands the pipeline model comes from the step's traces, and the prediction moves the way the cost
model says it must."""

import argparse
import math

import pytest

from experiments.benchmarks import rl_step
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn
from rstar2_jax.traces import TraceWriter, trajectory_record


def _trajectory(model_tokens: int, calls: int, tool_tokens: int, latency: float) -> Trajectory:
    """A rollout of a 5-token prompt, `model_tokens` of the model's and `tool_tokens` of tool output
    after each of `calls` calls."""
    response = [1] * model_tokens + [0] * (tool_tokens * calls)
    t = Trajectory(prompt_len=5, token_ids=[7] * 5 + response, loss_mask=[0] * 5 + response,
                   logprobs=[0.0] * (5 + len(response)), finish_reason="eos", response_text="r")
    tools = [ToolRecord("print(1)", "", "ok", "1\n", latency)]
    t.turns = [Turn("a", 1, "stop", 0, 0, list(tools)) for _ in range(calls)] + [Turn("b", 1, "eos", 0, 0)]
    return t


def _write(directory, trajectories):
    TraceWriter(directory / "traces").write(0, [
        trajectory_record(t, run="r", step=0, problem_id=f"p{i}", sample_index=i, gold="1", reward=0.0, p_err=0.0,
                          p_format=0.0, kept=True, advantage=0.0) for i, t in enumerate(trajectories)])


def test_the_workload_is_read_from_the_step_s_traces(tmp_path):
    # model tokens per turn: 40 / 2 and 90 / 3 -> 20 and 30; geometric mean sqrt(600)
    _write(tmp_path, [_trajectory(40, 1, 12, 0.1), _trajectory(90, 2, 12, 0.3)])
    (w,) = rl_step.read_workload(str(tmp_path))
    assert w["rollouts"] == 2 and w["prompt_tokens"] == 5
    assert w["mean_tool_calls"] == pytest.approx(1.5)
    assert w["tool_response_tokens"] == pytest.approx(12)
    assert w["turn_median"] == pytest.approx(math.sqrt(20 * 30))
    assert w["turn_sigma"] == pytest.approx(abs(math.log(30) - math.log(20)) / 2)
    assert w["tool_mean_s"] == pytest.approx((0.1 + 0.3 + 0.3) / 3)


def test_the_prediction_follows_the_hardware_it_is_given():
    workload = dict(rollouts=32, prompt_tokens=60, turn_median=80.0, turn_sigma=0.3, mean_tool_calls=1.0,
                    tool_response_tokens=10.0, tool_mean_s=0.02)
    args = argparse.Namespace(hbm_gb_s=4800.0, peak_tflops=989.0, per_sequence_us=2.5, slots=32)
    stage = {"max_response_tokens": 400, "max_turns": 4}
    base = rl_step.predicted(workload, args, 6e8, 114688.0, stage, 640, 0.5)
    assert base["rollout_s"] > 0 and base["learner_s"] > 0
    assert base["step_s"] == pytest.approx(base["rollout_s"] + base["learner_s"], rel=1e-6)
    tenth = argparse.Namespace(**{**vars(args), "hbm_gb_s": 480.0, "peak_tflops": 98.9})
    slower = rl_step.predicted(workload, tenth, 6e8, 114688.0, stage, 640, 0.5)
    assert slower["rollout_s"] > base["rollout_s"] and slower["learner_s"] == pytest.approx(10 * base["learner_s"])
