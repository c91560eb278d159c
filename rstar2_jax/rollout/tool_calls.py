"""Parsing `<tool_call>{json}</tool_call>` out of an assistant turn.

Every call either parses into (name, code, input) or yields an error message that goes back to
the model as its tool response (and counts toward p_err), as in rStar2-Agent: the policy learns
from malformed calls instead of the trajectory being dropped.
"""

from __future__ import annotations

import dataclasses
import json

from rstar2_jax.rollout.prompt import TOOL_NAME


@dataclasses.dataclass(frozen=True)
class ToolCall:
    raw: str                      # the text between the tags
    code: str | None = None
    stdin: str = ""
    error: str | None = None      # set when the call did not parse: this is the tool response

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_tool_calls(text: str, start: str = "<tool_call>", end: str = "</tool_call>",
                     tool_name: str = TOOL_NAME) -> list[ToolCall]:
    """All tool calls in a turn, in order. A start tag without an end tag is a call that failed."""
    calls = []
    pos = 0
    while True:
        i = text.find(start, pos)
        if i < 0:
            break
        j = text.find(end, i + len(start))
        nested = text.find(start, i + len(start))
        if j < 0:
            calls.append(ToolCall(raw=text[i + len(start):], error=f"Tool call error: missing {end}"))
            break
        if 0 <= nested < j:
            calls.append(ToolCall(raw=text[i + len(start):nested],
                                  error=f"Tool call error: {start} opened again before {end}"))
            pos = nested
            continue
        calls.append(_parse_one(text[i + len(start):j], tool_name))
        pos = j + len(end)
    return calls


def _parse_one(raw: str, tool_name: str) -> ToolCall:
    try:
        obj = json.loads(raw.strip())
    except json.JSONDecodeError as e:
        return ToolCall(raw, error=f"Tool call error: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}")
    if not isinstance(obj, dict):
        return ToolCall(raw, error="Tool call error: expected a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if name != tool_name:
        return ToolCall(raw, error=f"Tool call error: unknown tool {name!r}; the only tool is {tool_name!r}")
    args = obj.get("arguments")
    if isinstance(args, str):  # some models put the arguments object in a string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCall(raw, error=f"Tool call error: 'arguments' is not valid JSON: {e.msg}")
    if not isinstance(args, dict):
        return ToolCall(raw, error="Tool call error: 'arguments' must be an object with 'code' and 'input'")
    code = args.get("code")
    if not isinstance(code, str):
        return ToolCall(raw, error="Tool call error: missing string argument 'code'")
    stdin = args.get("input", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return ToolCall(raw, error="Tool call error: argument 'input' must be a string")
    return ToolCall(raw, code=code, stdin=stdin)
