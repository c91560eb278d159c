"""What the notebooks read off traces: token roles (forking / reflection), high-entropy tokens,
per-step stats by outcome and RoC, filters, and the trajectory viewer."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from rstar2_jax import traces
from rstar2_jax.rollout.trajectory import ToolRecord, Trajectory, Turn
from rstar2_jax.traces.entropy import FORKING, NOT_MODEL, REFLECTION


def reference_roles(mask, prompt_len, window):
    """token_roles written as the plain loop it vectorises."""
    roles, since = [], None
    for t, m in enumerate(mask):
        if not m:
            roles.append(NOT_MODEL)
            if t >= prompt_len:
                since = 0
            continue
        if since is not None and since < window:
            since += 1
            roles.append(REFLECTION)
        else:
            roles.append(FORKING)
    return roles


@given(st.lists(st.booleans(), min_size=1, max_size=80), st.integers(0, 10), st.integers(0, 6))
def test_token_roles_match_the_loop_definition(mask, prompt_len, window):
    mask = [False] * min(prompt_len, len(mask)) + mask[min(prompt_len, len(mask)):]
    roles = traces.token_roles(np.array(mask, np.int8), prompt_len, window)
    assert roles.tolist() == reference_roles(mask, prompt_len, window)
    assert ((roles == NOT_MODEL) == ~np.array(mask)).all()


def test_token_roles_on_a_two_turn_rollout():
    # prompt (3) | model (4) | tool (2) | model (5)
    mask = [0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    roles = traces.token_roles(mask, prompt_len=3, window=2).tolist()
    assert roles == [-1, -1, -1, 0, 0, 0, 0, -1, -1, 1, 1, 0, 0, 0]


def _row(step, sample, reward, statuses, kept, entropy=None, problem_id="p0"):
    n_model = 4
    t = Trajectory(prompt_len=2, token_ids=list(range(2 + n_model + 2 + n_model)),
                   loss_mask=[0, 0] + [1] * n_model + [0, 0] + [1] * n_model, logprobs=[0.0] * 12,
                   finish_reason="eos", response_text="r")
    t.turns = [Turn("<tool_call>...", n_model, "stop", 0, 0,
                    [ToolRecord(None if s == "parse_error" else f"print({i})", "", s, "out <b>&", 0.01)
                     for i, s in enumerate(statuses)]),
               Turn("<answer>\\boxed{1}</answer>", n_model, "eos", 0, 0)]
    return traces.trajectory_record(t, run="r", step=step, problem_id=problem_id, sample_index=sample,
                                    problem=f"What is {problem_id}?", gold="1", reward=reward, kept=kept,
                                    p_err=sum(s != "ok" for s in statuses) / max(len(statuses), 1),
                                    advantage=0.5 if kept else 0.0, entropy=entropy)


def _frame(tmp_path, rows_by_step):
    writer = traces.TraceWriter(tmp_path / "traces")
    for step, rows in rows_by_step.items():
        writer.write(step, rows)
    return traces.with_trajectory_columns(traces.read_traces(tmp_path / "traces"))


def test_step_stats_split_by_outcome_and_roc(tmp_path):
    df = _frame(tmp_path, {0: [_row(0, 0, 1.0, ["ok"], True), _row(0, 1, 1.0, ["error", "ok"], False),
                               _row(0, 2, 0.0, ["error"], True), _row(0, 3, 0.0, [], True)]})
    s = traces.step_stats(df).set_index(["outcome", "roc"])
    assert s.loc[("positive", "kept"), "tool_error_ratio_all"] == 0.0
    assert s.loc[("positive", "dropped"), "tool_error_ratio_all"] == pytest.approx(0.5)
    assert s.loc[("negative", "kept"), "rollouts"] == 2
    assert s.loc[("negative", "kept"), "tool_error_ratio_all"] == pytest.approx(1.0)  # 1 error / 1 call, pooled
    assert s.loc[("negative", "kept"), "tool_calls_per_turn"] == pytest.approx((1 / 2 + 0) / 2)
    assert (s["accuracy"] == s.index.get_level_values("outcome").map({"positive": 1.0, "negative": 0.0})).all()


def test_filters_and_viewer(tmp_path):
    df = _frame(tmp_path, {0: [_row(0, 0, 1.0, ["error", "ok"], True, problem_id="p1"),
                               _row(0, 1, 0.0, ["ok"], False, problem_id="p2")],
                           1: [_row(1, 0, 1.0, ["ok"], True, problem_id="p1")]})
    assert len(traces.filter_traces(df, positive=True, has_tool_error=True)) == 1
    assert list(traces.filter_traces(df, problem="p1")["step"]) == [0, 1]
    assert list(traces.filter_traces(df, problem="What is p2")["sample_index"]) == [1]
    assert traces.filter_traces(df, step=1, kept=False).empty
    row = df.iloc[0]
    text = traces.render_trajectory(row, html=False)
    assert "turn 0" in text and "turn 1" in text and "[tool error" in text and "print(0)" in text
    html = traces.render_trajectory(row)
    assert "out &lt;b&gt;&amp;" in html and "<b>error</b>" in html  # tool output escaped, status shown


def test_viewer_shows_a_tool_call_that_could_not_be_parsed(tmp_path):
    # the loop records such a call with no code (the demo's runs have hundreds of them)
    row = _frame(tmp_path, {0: [_row(0, 0, 0.0, ["parse_error", "ok"], False)]}).iloc[0]
    text = traces.render_trajectory(row, html=False)
    assert "[tool parse_error" in text and "could not be parsed" in text and "print(1)" in text
    html = traces.render_trajectory(row)
    assert "<b>parse_error</b>" in html and "could not be parsed" in html


def test_high_entropy_tokens_are_the_top_fraction_of_each_step(tmp_path):
    rng = np.random.default_rng(0)
    rows = {step: [_row(step, j, 1.0, ["ok"], True, entropy=rng.random(12).tolist()) for j in range(5)]
            + [_row(step, 9, 0.0, ["ok"], False)]  # dropped: no entropies, skipped
            for step in (0, 1)}
    df = _frame(tmp_path, rows)
    high = traces.high_entropy_tokens(df, top_frac=0.25, window=2)
    for step in (0, 1):
        model = np.concatenate([np.asarray(e)[np.asarray(m) > 0] for e, m in
                                zip(df[df.step == step]["entropy"].dropna(), df[df.step == step]["loss_mask"])])
        want = np.sort(model)[-int(np.ceil(0.25 * len(model))):]
        got = np.sort(high[high.step == step]["entropy"].to_numpy())
        np.testing.assert_allclose(got, want.astype(np.float32))
    # positions 8, 9 follow the tool response: reflection; 2..5 and 10, 11: forking
    assert set(high[high.role == "reflection"]["position"]) <= {8, 9}
    assert set(high[high.role == "forking"]["position"]) <= {2, 3, 4, 5, 10, 11}
    shares = traces.role_shares(high)
    assert ((shares["reflection_share"] >= 0) & (shares["reflection_share"] <= 1)).all()
    freq = traces.frequent_strings(high, lambda i: f"t{i}", k=3)
    assert len(freq) <= 3 and freq["count"].is_monotonic_decreasing and freq["token"].iloc[0].startswith("'t")


def test_high_entropy_tokens_need_entropies(tmp_path):
    df = _frame(tmp_path, {0: [_row(0, 0, 1.0, ["ok"], False)]})
    with pytest.raises(ValueError, match="no rollout has token entropies"):
        traces.high_entropy_tokens(df)
