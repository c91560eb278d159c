"""Prompt format strings and tool-call parsing."""

import json

import pytest

from rstar2_jax.rollout import PromptFormat, compact_format, parse_tool_calls
from rstar2_jax.rollout.prompt import TOOL_NAME, tool_output_text
from sandbox import ExecResult


def _call(code="print(1)", stdin="", name=TOOL_NAME):
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code, "input": stdin}}) + "</tool_call>"


def test_default_prompt_is_rstar2_format():
    text = PromptFormat().prompt("What is 1+1?")
    assert text.startswith("<|im_start|>system\n") and "<reason>" in text and "<answer>" in text
    assert TOOL_NAME in text and "<tools>" in text
    assert "This is the problem:\nWhat is 1+1?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<reason>")


def test_tool_turn_closes_the_assistant_turn_once():
    fmt = PromptFormat()
    open_turn = fmt.tool_turn(["42\n", "err"], assistant_turn_closed=False)
    assert open_turn == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n\n</tool_response>\n"
                         "<tool_response>\nerr\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>")
    assert not fmt.tool_turn(["x"], assistant_turn_closed=True).startswith("<|im_end|>")


@pytest.mark.parametrize("side,expect", [("left", "aaaa...(truncated)"), ("right", "(truncated)...bbbb"),
                                         ("middle", "aa...(truncated)...bb")])
def test_tool_output_truncation(side, expect):
    fmt = PromptFormat(max_tool_output_chars=4, truncate_side=side)
    assert fmt.truncate("a" * 10 + "b" * 10) == expect
    assert fmt.truncate("abc") == "abc"


def test_format_validation():
    with pytest.raises(ValueError, match="truncate_side"):
        PromptFormat(truncate_side="up")
    with pytest.raises(ValueError, match="{problem}"):
        PromptFormat(user_template="no placeholder")
    assert compact_format().prompt("2+2").count("<tools>") == 0


def test_parse_valid_calls_in_order():
    calls = parse_tool_calls("think " + _call("print(2)", "x") + " more " + _call("1+1"))
    assert [(c.code, c.stdin, c.ok) for c in calls] == [("print(2)", "x", True), ("1+1", "", True)]


@pytest.mark.parametrize("text,message", [
    ("<tool_call>{not json}</tool_call>", "invalid JSON at line 1"),
    ("<tool_call>[1, 2]</tool_call>", "expected a JSON object"),
    ('<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>', "unknown tool 'shell'"),
    ('<tool_call>{"name": "%s"}</tool_call>' % TOOL_NAME, "'arguments' must be an object"),
    ('<tool_call>{"name": "%s", "arguments": {"input": ""}}</tool_call>' % TOOL_NAME, "missing string argument 'code'"),
    ('<tool_call>{"name": "%s", "arguments": {"code": "1", "input": 5}}</tool_call>' % TOOL_NAME, "'input' must be a string"),
    ('<tool_call>{"name": "%s", "arguments": "{bad"}</tool_call>' % TOOL_NAME, "'arguments' is not valid JSON"),
    ("<tool_call>{\"name\": 1", "missing </tool_call>"),
    ("<tool_call>a<tool_call>" + _call()[len("<tool_call>"):], "opened again"),
])
def test_malformed_calls_become_tool_errors(text, message):
    calls = parse_tool_calls(text)
    assert calls and not calls[0].ok and message in calls[0].error


def test_nested_call_recovers_the_inner_one():
    calls = parse_tool_calls("<tool_call>oops " + _call("print(3)"))
    assert [c.ok for c in calls] == [False, True] and calls[1].code == "print(3)"


def test_arguments_as_json_string_and_null_input_are_accepted():
    raw = json.dumps({"name": TOOL_NAME, "arguments": json.dumps({"code": "print(1)", "input": None})})
    (call,) = parse_tool_calls(f"<tool_call>{raw}</tool_call>")
    assert call.ok and call.code == "print(1)" and call.stdin == ""


def test_no_calls():
    assert parse_tool_calls("just text </tool_call>") == []


@pytest.mark.parametrize("result,text", [
    (ExecResult("ok", "5\n"), "5\n"),
    (ExecResult("ok", ""), "(no output)"),
    (ExecResult("error", "partial\n", "Traceback...\nZeroDivisionError: x\n", 1),
     "partial\n\nTraceback...\nZeroDivisionError: x"),
    (ExecResult("timeout", "", "TimeoutError: ...", -9), "Timeout: the code did not finish in time."),
])
def test_tool_output_text(result, text):
    assert tool_output_text(result) == text


def test_default_prompt_is_the_release_chat_template_rendering():
    """What rstar2_agent_trainer.yaml's chat template renders for [user: P] with the python tool
    of python_tool_config.yaml and add_generation_prompt (written out here from that template)."""
    fmt = PromptFormat()
    system = ("A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
              "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
              "the answer. The reasoning process is enclosed within <reason> </reason> and answer is enclosed within "
              "<answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer "
              "here </answer>.")
    tool = json.dumps(fmt.tools[0])
    want = ("<|im_start|>system\n" + system + "\n\n# Tools\n\nYou may call one or more functions to assist with the "
            "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + tool + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nYou must put your answer inside <answer> "
            "</answer> tags, i.e., <answer> answer here </answer>. And your final answer will be extracted "
            "automatically by the \\boxed{} tag.\nThis is the problem:\nP<|im_end|>\n<|im_start|>assistant\n<reason>")
    assert fmt.prompt("P") == want
    schema = fmt.tools[0]["function"]
    assert schema["name"] == "python_code_with_standard_io" and schema["parameters"]["required"] == ["code", "input"]
    assert not fmt.tool_call_stops_turn  # the model closes its tool-call turns with <|im_end|>
