"""The grader reads the text the model wrote: through the agent loop, with the tiny tokenizer's real
special tokens (`<|im_end|>` is its EOS, as Qwen's; `<|im_start|>` and the pad are special too),
for every answer format and for answers that are not integers. Issue 69: "Answer: \\frac{1}{2}"
followed by EOS reached the `dapo` format as `\\frac{1}{2}<|im_end|>` and scored 0."""

import asyncio

import pytest

from rstar2_jax.rewards import Grader
from rstar2_jax.rollout import AgentConfig, compact_format, run_agent
from rstar2_jax.rollout.scoring import rollout_problems
from rstar2_jax.rollout.trajectory import model_text
from rstar2_jax.traces import answer_context, trajectory_record
from tests.rollout.test_agent_loop import ScriptedEngine, call, run

EOS = "<|im_end|>"
FMT = compact_format()

# (answer format, the model's last turn before its EOS, gold): a fraction, a root, an expression,
# an interval, a decimal, a choice letter; every one right when the EOS is left out.
CASES = [
    ("dapo", "So the probability is a half.\nAnswer: \\frac{1}{2}", "\\frac{1}{2}"),
    ("dapo", "The side is\nAnswer: \\sqrt{2}", "\\sqrt{2}"),
    ("dapo", "Simplified:\nAnswer: x+1", "x+1"),
    ("dapo", "The solution set:\nAnswer: (0, 1]", "(0,1]"),
    ("boxed", "Hence $\\boxed{\\frac{3}{4}}$", "3/4"),
    ("answer_boxed", "<answer>\\boxed{2\\sqrt{3}}</answer>", "2\\sqrt{3}"),
    ("gsm8k", "She pays 3.5 dollars.\n#### 3.5", "3.5"),
    ("choice_letter", "Comparing the options,\nAnswer: B", "B"),
]


def _graded(tokenizer, answer_format, last_turn, gold, multiple_choice=False):
    engine = ScriptedEngine(tokenizer, [last_turn + EOS])
    grader = Grader(answer_format, multiple_choice=multiple_choice)
    # no tool call in one turn: the sandbox is never asked (None stands for it)
    [scored] = asyncio.run(rollout_problems(engine, None, tokenizer, ["q"], [gold], AgentConfig(format=FMT), [0],
                                            grader=grader))
    return scored


@pytest.mark.parametrize("answer_format,last_turn,gold", CASES)
def test_a_final_turn_ended_by_eos_is_graded_without_it(tokenizer, answer_format, last_turn, gold):
    scored = _graded(tokenizer, answer_format, last_turn, gold, multiple_choice=answer_format == "choice_letter")
    traj = scored.trajectory
    assert traj.finish_reason == "eos"
    assert traj.token_ids[-1] == tokenizer.eos_token_id            # the trace keeps the raw tokens
    assert traj.response_text.endswith(EOS) and EOS not in traj.graded_text
    assert traj.graded_text == last_turn
    assert scored.reward == 1.0 and EOS not in scored.answer


def test_special_tokens_inside_a_turn_are_left_out_and_turns_are_read_apart(tokenizer):
    """A chat-template marker the model wrote mid-turn, and a two-turn rollout: the grader reads
    each run of model tokens decoded without special tokens, one line between runs, and never
    the tool's output (the model did not write it: a printed "Answer: 99" is not its answer)."""
    turns = ["Check: " + call("print('Answer: 99')"), "<|im_start|>Answer: \\frac{5}{7}" + EOS]
    engine = ScriptedEngine(tokenizer, turns)
    traj = run(lambda sb: run_agent(engine, sb, tokenizer, "q", AgentConfig(format=FMT)))
    assert traj.tool_statuses == ["ok"] and "Answer: 99" in traj.response_text
    assert traj.graded_text == model_text(tokenizer, traj) == "Check: " + call("print('Answer: 99')") + \
        "\nAnswer: \\frac{5}{7}"
    assert Grader("dapo")(traj.graded_text, "5/7").reward == 1.0
    assert Grader("dapo")(traj.response_text, "5/7").reward == 0.0  # the raw text holds the EOS after it


def test_the_trace_keeps_the_graded_text_and_the_viewer_shows_where_the_answer_was_read(tokenizer):
    scored = _graded(tokenizer, "dapo", "Half of it.\nAnswer: \\frac{1}{2}", "1/2")
    record = trajectory_record(scored.trajectory, run="r", step=0, problem_id="p", sample_index=0,
                               extracted_answer=scored.answer, reward=scored.reward)
    assert record["graded_text"] == "Half of it.\nAnswer: \\frac{1}{2}"
    assert record["token_ids"][-1] == tokenizer.eos_token_id
    before, answer, after = answer_context(record)
    assert (before.endswith("Answer: "), answer, after) == (True, "\\frac{1}{2}", "")
    from rstar2_jax.traces import render_trajectory
    record.update(kept=False, advantage=0.0, p_err=0.0)
    assert "[[\\frac{1}{2}]]" in render_trajectory(record, html=False)
    assert "<mark>\\frac{1}{2}</mark>" in render_trajectory(record)
