"""The synthetic tool-use task of the CPU demo: multi-digit arithmetic the tiny model cannot do
in its head but can do with one Python call, plus synthetic SFT traces, some of them imperfect.

A clean trace: call python with the expression, read the result, answer it. Imperfect ones (so
that RL has something to fix, and RoC something to prefer against):
- wrong_copy: a digit of an operand mistyped in the code, so the answer is wrong;
- error_then_fix: a call with a syntax error, its traceback, then the correct call;
- no_tool: an answer guessed without calling the tool (almost always wrong).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import traceback

from rstar2_jax.rollout.prompt import TINY_TOOL_NAME, PromptFormat


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str
    expression: str


def make_problems(n: int, seed: int, *, min_digits: int = 3, max_digits: int = 4) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a = rng.randint(10 ** (min_digits - 1), 10 ** max_digits - 1)
        b = rng.randint(10 ** (min_digits - 1), 10 ** max_digits - 1)
        op = rng.choice(["*", "+", "-"])
        expr = f"{a}{op}{b}"
        out.append(Problem(f"{seed}-{i}", f"What is {a}{op}{b}?", str(eval(expr)), expr))  # noqa: S307 - our own digits
    return out


def tool_call_text(code: str, tool_name: str = TINY_TOOL_NAME) -> str:
    return "<tool_call>" + json.dumps({"name": tool_name, "arguments": {"code": code}}) + "</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>\\boxed{{{answer}}}</answer>"


def _mistype(expr: str, rng: random.Random) -> str:
    # never the first digit of an operand: "0548" is not a Python literal
    digits = [i for i, c in enumerate(expr) if c.isdigit() and i > 0 and expr[i - 1].isdigit()]
    i = rng.choice(digits)
    wrong = rng.choice([d for d in "0123456789" if d != expr[i]])
    return expr[:i] + wrong + expr[i + 1:]


def syntax_error_text(code: str) -> str:
    """What the sandbox answers for code that does not compile: the traceback as its zygote
    formats it (user frames only), stripped as the tool turn shows it. The SFT traces must show
    the model the real text, or after a real error it is off its training distribution and never
    learns to recover (which leaves RoC nothing to choose between among correct rollouts)."""
    try:
        ast.parse(code, "<code>")
    except SyntaxError as e:
        return "".join(traceback.format_exception_only(e)).strip()  # no user frames: it never ran
    raise ValueError(f"not a syntax error: {code!r}")


def sft_trace(problem: Problem, kind: str, rng: random.Random) -> list[tuple[str, str]]:
    """The trace as (role, text) pieces: role "model" (trained on) or "tool" (the tool turn text
    is produced by the format at tokenization time from the output given here)."""
    if kind == "clean":
        return [("model", tool_call_text(f"print({problem.expression})")), ("tool", problem.answer + "\n"),
                ("model", answer_text(problem.answer))]
    if kind == "wrong_copy":
        bad = _mistype(problem.expression, rng)
        result = str(eval(bad))  # noqa: S307
        return [("model", tool_call_text(f"print({bad})")), ("tool", result + "\n"), ("model", answer_text(result))]
    if kind == "error_then_fix":
        broken = f"print({problem.expression}"
        error = syntax_error_text(broken)
        return [("model", tool_call_text(broken)), ("tool", error), ("model", tool_call_text(f"print({problem.expression})")),
                ("tool", problem.answer + "\n"), ("model", answer_text(problem.answer))]
    if kind == "no_tool":
        guess = str(int(problem.answer) + rng.choice([-1, 1]) * rng.randint(1, 999))
        return [("model", answer_text(guess))]
    raise ValueError(f"unknown trace kind {kind!r}")


def tokenize_trace(tokenizer, fmt: PromptFormat, problem: Problem, pieces, eos: str = "<|im_end|>"):
    """(token_ids, loss_mask) exactly as the agent loop would build them: prompt, then each model
    turn (mask 1; the last ends with EOS) and each tool turn (mask 0), tokenized piece by piece."""
    ids = tokenizer.encode(fmt.prompt(problem.question))
    mask = [0] * len(ids)
    for i, (role, text) in enumerate(pieces):
        if role == "model":
            last = i == len(pieces) - 1
            piece = tokenizer.encode(text + (eos if last else ""))
            ids += piece
            mask += [1] * len(piece)
        else:
            piece = fmt.tool_turn_ids(tokenizer, [text], assistant_turn_closed=False)
            ids += piece
            mask += [0] * len(piece)
    return ids, mask


TRACE_MIX = (("clean", 0.55), ("wrong_copy", 0.15), ("error_then_fix", 0.15), ("no_tool", 0.15))


def sft_dataset(tokenizer, fmt: PromptFormat, n: int, seed: int, mix=TRACE_MIX):
    rng = random.Random(seed)
    kinds, weights = zip(*mix)
    out = []
    for problem in make_problems(n, seed):
        kind = rng.choices(kinds, weights)[0]
        out.append(tokenize_trace(tokenizer, fmt, problem, sft_trace(problem, kind, rng)))
    return out
