"""RoC penalties of one trajectory (rStar2-Agent, section 3): lower is cleaner.

p_err = (tool calls that failed: parse errors, execution errors, timeouts) / tool calls, and 0.5
for a trajectory without tool calls (neutral: neither clean nor noisy). p_format = 1 with no
<answer> block, else min(1, (answer blocks - 1) / turns).
"""

from __future__ import annotations

from typing import Sequence

FAILED_TOOL_STATUSES = frozenset({"parse_error", "error", "timeout", "memory", "output_limit", "killed",
                                  "internal"})


def tool_error_ratio(tool_statuses: Sequence[str]) -> float:
    if not tool_statuses:
        return 0.5
    return sum(s in FAILED_TOOL_STATUSES for s in tool_statuses) / len(tool_statuses)


def format_penalty(response_text: str, num_turns: int) -> float:
    answers = response_text.count("<answer>")
    if answers == 0:
        return 1.0
    return min(1.0, (answers - 1) / max(num_turns, 1))
