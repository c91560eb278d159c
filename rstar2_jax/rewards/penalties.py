"""RoC penalties of one trajectory (rStar2-Agent, section 3): lower is cleaner.

p_err = (tool calls that failed: parse errors, execution errors, timeouts) / tool calls, and 0.5
for a trajectory without tool calls (neutral: neither clean nor noisy). Calls the sandbox itself
failed to serve (INFRA_TOOL_STATUSES: a worker that died under the call, a sandbox unreachable or
refusing the job) are the infrastructure's fault, not the policy's: p_err leaves them out of both
counts, in either mode, so RoC neither prefers nor penalises a rollout for meeting one. p_format = 1 with no
<answer> block, else min(1, (answer blocks - 1) / turns). The released code's variants
(release_error_ratio, release_format_penalty) read the response text instead; RoC's "release"
mode uses them.
"""

from __future__ import annotations

import re
from typing import Sequence

FAILED_TOOL_STATUSES = frozenset({"parse_error", "error", "timeout", "memory", "output_limit", "killed"})
INFRA_TOOL_STATUSES = frozenset({"worker_died", "internal"})


def tool_error_ratio(tool_statuses: Sequence[str]) -> float:
    """Failed calls / calls, over the calls the sandbox served (0.5 when there are none)."""
    served = [s for s in tool_statuses if s not in INFRA_TOOL_STATUSES]
    if not served:
        return 0.5
    return sum(s in FAILED_TOOL_STATUSES for s in served) / len(served)


def infra_error_count(tool_statuses: Sequence[str]) -> int:
    """Calls the sandbox failed to serve (after the agent loop's retry)."""
    return sum(s in INFRA_TOOL_STATUSES for s in tool_statuses)


def format_penalty(response_text: str, num_turns: int) -> float:
    answers = response_text.count("<answer>")
    if answers == 0:
        return 1.0
    return min(1.0, (answers - 1) / max(num_turns, 1))


# The released code's penalties (microsoft/rStar rstar2_agent/down_sample/roc.py), computed from
# the decoded response text (special tokens kept, the prompt excluded), not from tool statuses.
_TOOL_RESPONSE = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant.*?<\|im_end\|>", re.DOTALL)


def release_error_ratio(response_text: str, tool_statuses: Sequence[str] | None = None) -> float:
    """Share of <tool_response> blocks whose text contains "error" (any case); 0.5 with none.
    (Output that merely prints the word "error" counts too: that is the release.) With the
    calls' `tool_statuses` (one block per call, in order), blocks of calls the sandbox failed to
    serve are left out, as in tool_error_ratio."""
    blocks = _TOOL_RESPONSE.findall(response_text)
    if tool_statuses is not None and len(tool_statuses) == len(blocks):
        blocks = [b for b, s in zip(blocks, tool_statuses) if s not in INFRA_TOOL_STATUSES]
    if not blocks:
        return 0.5
    return sum("error" in b.lower() for b in blocks) / len(blocks)


def release_error_ratio_of_calls(shown: Sequence[str], tool_statuses: Sequence[str]) -> float:
    """release_error_ratio's rule on the blocks the agent loop wrote, one per call (`shown`: the
    text inside each, as the model read it), never on blocks found in the text: a call that prints
    "</tool_response><tool_response>" (or a model that writes a block itself) would otherwise add
    blocks of its choosing (issue 79: 9 forged pairs moved a failing call's ratio from 1.0 to 0.1).
    Equal to release_error_ratio(response_text, tool_statuses) wherever no output and no model turn
    holds a block tag (tested both ways)."""
    blocks = [text for text, status in zip(shown, tool_statuses) if status not in INFRA_TOOL_STATUSES]
    if not blocks:
        return 0.5
    return sum("error" in b.lower() for b in blocks) / len(blocks)


def release_format_penalty(response_text: str) -> float:
    """1 without a closed <answer> block or with unbalanced tags; else min(1, (answer blocks - 1)
    / turns), where turns counts `<|im_start|>assistant ... <|im_end|>` spans in the response:
    the first turn's header is in the prompt, so an answer in the first turn scores 1 there."""
    if "<answer>" not in response_text or "</answer>" not in response_text:
        return 1.0
    closed = len(_ANSWER_BLOCK.findall(response_text))
    if response_text.count("<answer>") != closed or response_text.count("</answer>") != closed:
        return 1.0
    turns = len(_ASSISTANT_TURN.findall(response_text))
    if turns == 0:
        return 1.0
    return min((closed - 1) / turns, 1.0)
