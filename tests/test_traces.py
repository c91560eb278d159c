"""Trace files: write -> read round trip, schema, crash safety."""

import os

import numpy as np
import pytest

from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn
from rstar2_jax.traces import SCHEMA, TraceWriter, read_traces, trajectory_record


def _traj(i):
    t = Trajectory(prompt_len=3, token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0, 0, 0, 1, 0, 1],
                   logprobs=[0, 0, 0, -0.25, 0, -1.5], finish_reason="eos", response_text=f"resp {i} é",
                   generation_s=0.5, tool_s=0.25)
    t.turns = [Turn("a<tool_call>", 1, "stop", 3, 4, [ToolRecord("print(1)", "", "ok", "1\n", 0.01)]),
               Turn("b", 1, "eos", 4, 4)]
    return t


def test_round_trip(tmp_path):
    writer = TraceWriter(tmp_path / "traces")
    for step in (0, 1):
        writer.write(step, [trajectory_record(_traj(i), run="r", step=step, problem_id=f"p{i}", sample_index=i,
                                              gold="1", reward=float(i % 2), p_err=0.0, p_format=0.0,
                                              kept=bool(i % 2), advantage=0.5) for i in range(3)])
    df = read_traces(tmp_path / "traces")
    assert list(df.columns) == SCHEMA.names and len(df) == 6
    assert list(df["step"]) == [0, 0, 0, 1, 1, 1]
    row = df.iloc[1]
    assert row["response_text"] == "resp 1 é" and row["policy_version"] == 3 and row["kept"]
    assert list(row["token_ids"]) == [1, 2, 3, 4, 5, 6] and list(row["loss_mask"]) == [0, 0, 0, 1, 0, 1]
    np.testing.assert_allclose(list(row["logprobs"]), [0, 0, 0, -0.25, 0, -1.5])
    turn0 = row["turns"][0]
    assert turn0["tools"][0]["status"] == "ok" and turn0["version_end"] == 4
    assert row["num_tool_calls"] == 1 and row["num_turns"] == 2
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path / "traces"))


def test_missing_traces_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no step_"):
        read_traces(tmp_path)
