"""`rl.roc.mode=release`: the released code's selection and its penalties, by the release's text
rules applied to what the rollout itself wrote, never to what its tools printed (docs/FIDELITY.md
compares it with the paper's)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rstar2_jax.algo.roc import ReleaseSelection, release_selection
from rstar2_jax.rewards.penalties import release_error_ratio_of_calls, release_format_penalty
from rstar2_jax.rl.roc_modes.base import ROC_MODES, RoCMode
from rstar2_jax.rollout.scoring import Scored
from rstar2_jax.rollout.trajectory import Trajectory


def release_penalties(group: Sequence[Scored]) -> tuple[np.ndarray, np.ndarray]:
    """(p_err, p_format) per rollout by the released code's rules, on what the rollout itself
    wrote: p_err over the agent loop's own blocks (one a call; those the sandbox failed to serve
    left out: penalties.INFRA_TOOL_STATUSES), p_format on the response text without the tools'
    outputs. Nothing a call prints counts as a block, an answer or a turn (issue 79); on responses
    whose outputs and turns hold none of those tags these are the release's text rules exactly."""
    return (np.array([release_error_ratio_of_calls(shown_outputs(s.trajectory), s.trajectory.tool_statuses)
                      for s in group]),
            np.array([release_format_penalty(without_tool_outputs(s.trajectory)) for s in group]))


def shown_outputs(traj: Trajectory) -> list[str]:
    """What the model read of each call, in order (the whole output for records kept before `shown`)."""
    return [_shown(t) for turn in traj.turns for t in turn.tools]


def _shown(tool) -> str:
    return tool.shown if tool.shown is not None else tool.output


def without_tool_outputs(traj: Trajectory) -> str:
    """The response text with the text of every tool output taken out (the format's framing stays),
    each found after its turn's own text; the text as it is where one cannot be found."""
    text, spans, cursor = traj.response_text, [], 0
    for turn in traj.turns:
        at = text.find(turn.text, cursor)
        if at < 0:
            return text
        cursor = at + len(turn.text)
        for tool in turn.tools:
            shown = _shown(tool)
            at = text.find(shown, cursor)
            if at < 0:
                return text
            spans.append((at, at + len(shown)))
            cursor = at + len(shown)
    kept, prev = [], 0
    for a, b in spans:
        kept.append(text[prev:a])
        prev = b
    return "".join(kept) + text[prev:]


ROC_MODES.register("release", RoCMode(release_selection, release_penalties, ReleaseSelection))
