"""The prompt format: every string the policy sees that is not its own, kept in config.

Default = rStar2-Agent's release (microsoft/rStar rstar2_agent/config: the chat template of
rstar2_agent_trainer.yaml and the tool schema of tool_config/python_tool_config.yaml): its
default system prompt (the <reason>/<answer> conversation prompt of the paper's Fig. 3) followed
by the Hermes tools block declaring `python_code_with_standard_io(code, input)`; the user
template; generation prefix `<|im_start|>assistant\n<reason>`. The model ends every turn itself
with `<|im_end|>`, tool calls included (that token is trained); tool results come back as one
user turn of <tool_response> blocks, right after the model's `<|im_end|>`, and the next
assistant turn opens with the same `<|im_start|>assistant\n<reason>` header.

`compact_format()` is the same protocol with short strings, for the tiny CPU model, and
`tiny_format()` the CPU demo's (tool named "python"). Both stop a turn at `</tool_call>` (the
format closes the turn), which sends the call to the sandbox a few tokens earlier. FORMATS is
the one table of named formats that train (`--config.format`), evaluate and chat (`--format`)
choose from.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

from rstar2_jax.core.registry import Registry

TOOL_NAME = "python_code_with_standard_io"

PYTHON_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Execute Python code with standard input and capture standard output. This function "
                       "takes a Python code string and an input string, provides the input string through "
                       "standard input (stdin) to the code, and captures and returns any output produced "
                       "through standard output (stdout). If the executed code raises an exception, the "
                       "error message will be captured and returned instead.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "A string containing Python code to be executed. The "
                                                          "code can read from standard input using the input() "
                                                          "function."},
                "input": {"type": "string", "description": "A string that will be provided as standard input to "
                                                           "the code when it calls input()."},
            },
            "required": ["code", "input"],
        },
    },
}

DEFAULT_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The "
    "Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <reason> </reason> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>."
)
DEFAULT_USER = ("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
                "And your final answer will be extracted automatically by the \\boxed{{}} tag.\n"
                "This is the problem:\n{problem}")
TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    system: str = DEFAULT_SYSTEM
    user_template: str = DEFAULT_USER                # {problem}
    tools: tuple[dict, ...] = (PYTHON_TOOL_SCHEMA,)
    tool_name: str = TOOL_NAME                       # the name a call must use
    tools_block: str = TOOLS_BLOCK                   # {tools}: one JSON schema per line; "" = none
    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    generation_prefix: str = "<reason>"              # after "<|im_start|>assistant\n", every turn
    tool_call_stops_turn: bool = False               # True: a turn ends at </tool_call> and the format
                                                     # closes it; False: the model closes it with EOS
    tool_call_start: str = "<tool_call>"
    tool_call_end: str = "</tool_call>"
    tool_response_start: str = "<tool_response>\n"
    tool_response_end: str = "\n</tool_response>"
    max_tool_output_chars: int = 2048
    truncate_side: str = "middle"                    # left (keep the start) | right (keep the end) | middle
    answer_format: str = "answer_boxed"              # the answer format its own instructions ask for ('':
                                                     # none; a set's kept template then instructs alone)

    def __post_init__(self):
        if self.truncate_side not in ("left", "right", "middle"):
            raise ValueError(f"truncate_side must be left, right or middle, got {self.truncate_side!r}")
        if "{problem}" not in self.user_template:
            raise ValueError("user_template must contain {problem}")

    def system_text(self) -> str:
        text = self.system
        if self.tools and self.tools_block:
            text += self.tools_block.format(tools="\n".join(json.dumps(t) for t in self.tools))
        return text

    def prompt(self, problem: str) -> str:
        """Everything before the model's first token."""
        return (f"{self.turn_start}system\n{self.system_text()}{self.turn_end}\n"
                f"{self.turn_start}user\n{self.user_template.format(problem=problem)}{self.turn_end}\n"
                f"{self.turn_start}assistant\n{self.generation_prefix}")

    def tool_turn_pieces(self, outputs: Sequence[str], assistant_turn_closed: bool) -> list[tuple[str, bool]]:
        """The tool turn as (text, is_output) pieces: close the assistant turn, one user turn with a
        <tool_response> block per call (its output truncated), open the next assistant turn."""
        close = "" if assistant_turn_closed else f"{self.turn_end}\n"
        pieces = [(f"{close}{self.turn_start}user\n", False)]
        for i, output in enumerate(outputs):
            pieces += [(("\n" if i else "") + self.tool_response_start, False), (self.truncate(output), True),
                       (self.tool_response_end, False)]
        pieces.append((f"{self.turn_end}\n{self.turn_start}assistant\n{self.generation_prefix}", False))
        return pieces

    def tool_turn(self, outputs: Sequence[str], assistant_turn_closed: bool) -> str:
        """Text appended after an assistant turn that ended in tool calls (tool_turn_pieces joined)."""
        return "".join(text for text, _ in self.tool_turn_pieces(outputs, assistant_turn_closed))

    def tool_turn_ids(self, tokenizer, outputs: Sequence[str], assistant_turn_closed: bool) -> list[int]:
        """The tool turn's token ids, its outputs read as text, never as framing (issue 79): what a
        call prints cannot become a turn marker, a <tool_response> tag or EOS. Where no output holds
        an added token's text, these are the ids of tool_turn()'s whole text (what was trained and
        what the release tokenizes); otherwise the framing is tokenized piece by piece around the
        outputs, which go through tokenizer.encode_text."""
        ids = tokenizer.encode(self.tool_turn(outputs, assistant_turn_closed))
        control = tokenizer.added_token_ids
        framing = tokenizer.encode(self.tool_turn([""] * len(outputs), assistant_turn_closed))
        if [i for i in ids if i in control] == [i for i in framing if i in control]:
            return ids
        return [i for text, is_output in self.tool_turn_pieces(outputs, assistant_turn_closed)
                for i in (tokenizer.encode_text(text) if is_output else tokenizer.encode(text))]

    def truncate(self, text: str) -> str:
        n = self.max_tool_output_chars
        if len(text) <= n:
            return text
        if self.truncate_side == "left":
            return text[:n] + "...(truncated)"
        if self.truncate_side == "right":
            return "(truncated)..." + text[-n:]
        return text[:n // 2] + "...(truncated)..." + text[-(n - n // 2):]


def compact_format(**overrides: Any) -> PromptFormat:
    """Same protocol, short strings: for the tiny model, whose context is small."""
    fields = dict(system="Solve with python. Answer in <answer>\\boxed{}</answer>.", tools=(), tools_block="",
                  user_template="{problem}", generation_prefix="", max_tool_output_chars=200,
                  tool_call_stops_turn=True)
    fields.update(overrides)
    return PromptFormat(**fields)


TINY_TOOL_NAME = "python"


def tiny_format() -> PromptFormat:
    """The CPU demo's compact protocol: short system prompt, tool named "python"."""
    return compact_format(system="Use python.", tool_name=TINY_TOOL_NAME, max_tool_output_chars=120, answer_format="")


# Named prompt formats: a model is trained in one and must be driven in the same one.
FORMATS: Registry[Callable[[], PromptFormat]] = Registry("prompt format")
FORMATS.register("rstar2", PromptFormat)
FORMATS.register("compact", compact_format)
FORMATS.register("tiny", tiny_format)


def make_format(name: str) -> PromptFormat:
    return FORMATS[name]()


def tool_output_text(result) -> str:
    """What the model reads for one execution (ExecResult-like: status, stdout, stderr).

    The four outcomes of rStar2-Agent: stdout (or the repr of the last expression, which the
    sandbox already put in stdout), the error with its traceback, or the timeout.
    """
    if result.status == "ok":
        return result.stdout if result.stdout else "(no output)"
    if result.status == "timeout":
        return (result.stdout + "\n" if result.stdout else "") + "Timeout: the code did not finish in time."
    return "\n".join(part for part in (result.stdout, result.stderr.strip()) if part) or f"Error: {result.status}"
