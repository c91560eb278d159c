"""One rollout rendered turn by turn: the model's text, each tool call's code, status and output."""

from __future__ import annotations

import html as html_lib
from typing import Any

_STATUS_COLOR = {"ok": "#1a7f37", "error": "#cf222e", "timeout": "#9a6700", "parse_error": "#8250df"}


def _header(row: Any) -> str:
    return (f"step {row['step']}  problem {row['problem_id']}  sample {row['sample_index']}  reward {row['reward']:.0f}  "
            f"{'kept' if row['kept'] else 'dropped'} (advantage {row['advantage']:+.2f}, p_err {row['p_err']:.2f})  "
            f"{row['num_turns']} turns, {row['num_tool_calls']} tool calls, {row['num_response_tokens']} tokens, "
            f"finish {row['finish_reason']}")


def _code_of(tool) -> str:
    """A tool call's code; a call the loop could not parse has none (its output says why)."""
    return "(no code: the tool call could not be parsed)" if tool["code"] is None else tool["code"]


def extracted(row: Any) -> str:
    """The answer read in the run's answer format, or that there was none (a format failure)."""
    answer = row["extracted_answer"]
    return "none in the graded answer format (format failure)" if answer is None or answer != answer else str(answer)


ANSWER_CONTEXT_CHARS = 80


def answer_context(row: Any, width: int = ANSWER_CONTEXT_CHARS) -> tuple[str, str, str] | None:
    """Where the grader read the answer: (text before, the answer, text after) around its last
    occurrence in the graded text (the model's own words, special tokens left out), `width`
    characters each side; None where there is no answer or no graded text (older traces)."""
    answer, text = row["extracted_answer"], row.get("graded_text") if hasattr(row, "get") else None
    if answer is None or answer != answer or not isinstance(text, str):
        return None
    at = text.rfind(str(answer))
    if at < 0:
        return None
    end = at + len(str(answer))
    return text[max(0, at - width):at], text[at:end], text[end:end + width]


def _read_at_line(row: Any, html: bool) -> str | None:
    around = answer_context(row)
    if around is None:
        return None
    before, answer, after = around
    if not html:
        return f"answer read at: ...{before}[[{answer}]]{after}..."
    esc = html_lib.escape
    return (f"<div><i>answer read at</i>: <span style='white-space:pre-wrap'>...{esc(before)}"
            f"<mark>{esc(answer)}</mark>{esc(after)}...</span></div>")


def render_trajectory(row: Any, html: bool = True) -> str:
    """`row`: one trace row (a pandas Series or a dict). HTML for notebooks, or plain text."""
    turns = list(row["turns"])
    if not html:
        out = [_header(row), f"problem: {row['problem']}", f"gold: {row['gold']}  extracted: {extracted(row)}"]
        out += [line for line in [_read_at_line(row, html=False)] if line]
        for i, turn in enumerate(turns):
            out.append(f"--- turn {i} ({turn['num_tokens']} tokens, {turn['finish_reason']}) ---")
            out.append(turn["text"])
            for tool in turn["tools"]:
                out.append(f"  [tool {tool['status']}, {tool['latency_s'] * 1000:.0f} ms] code:")
                out.extend("    " + line for line in _code_of(tool).splitlines())
                out.append("  output:")
                out.extend("    " + line for line in tool["output"].splitlines())
        return "\n".join(out)
    esc = html_lib.escape
    pre = "white-space:pre-wrap;margin:2px 0;padding:4px;border-radius:4px;font-size:12px"
    out = [f"<div style='font-family:monospace'><b>{esc(_header(row))}</b>",
           f"<div><i>problem</i>: {esc(str(row['problem']))}</div>",
           f"<div><i>gold</i>: {esc(str(row['gold']))} &nbsp; <i>extracted</i>: {esc(extracted(row))}</div>"]
    out += [line for line in [_read_at_line(row, html=True)] if line]
    for i, turn in enumerate(turns):
        out.append(f"<div style='margin-top:6px'><b>turn {i}</b> "
                   f"({turn['num_tokens']} tokens, {esc(turn['finish_reason'])})</div>")
        out.append(f"<pre style='{pre};background:#f6f8fa'>{esc(turn['text'])}</pre>")
        for tool in turn["tools"]:
            color = _STATUS_COLOR.get(tool["status"], "#57606a")
            out.append(f"<div style='margin-left:16px'><span style='color:{color}'><b>{esc(tool['status'])}</b></span> "
                       f"({tool['latency_s'] * 1000:.0f} ms)"
                       f"<pre style='{pre};background:#eef'>{esc(_code_of(tool))}</pre>"
                       f"<pre style='{pre};background:#ffe;border-left:3px solid {color}'>{esc(tool['output'])}</pre></div>")
    out.append("</div>")
    return "\n".join(out)
