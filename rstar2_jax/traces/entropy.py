"""High-entropy tokens of sampled rollouts, split as in rStar2-Agent's token-entropy analysis:
forking tokens (inside the model's own reasoning, where it decides how to go on) and reflection
tokens (the first model tokens after a tool response, where it reacts to what the tool said).

The entropies are the learner's (the `entropy` trace column, written for kept rollouts by the
log-prob pass of each update), so the analysis is the same for every rollout engine.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

NOT_MODEL, FORKING, REFLECTION = -1, 0, 1
ROLE_NAMES = {FORKING: "forking", REFLECTION: "reflection"}


def token_roles(loss_mask, prompt_len: int, window: int = 16) -> np.ndarray:
    """Per position: NOT_MODEL (prompt and tool tokens), REFLECTION (one of the first `window`
    model tokens after a tool response) or FORKING (any other model token)."""
    model = np.asarray(loss_mask) > 0
    idx = np.arange(len(model))
    tool = ~model & (idx >= prompt_len)
    last_tool = np.maximum.accumulate(np.where(tool, idx, -1))           # latest tool position <= t
    seen = np.cumsum(model)                                               # model tokens in [0, t]
    since_tool = seen - np.where(last_tool >= 0, seen[np.maximum(last_tool, 0)], 0)
    roles = np.where(model, FORKING, NOT_MODEL).astype(np.int8)
    roles[model & (last_tool >= 0) & (since_tool <= window)] = REFLECTION
    return roles


def high_entropy_tokens(df: pd.DataFrame, top_frac: float = 0.2, window: int = 16) -> pd.DataFrame:
    """The top `top_frac` highest-entropy model tokens of each step (rows without entropies, i.e.
    rollouts dropped by RoC, are skipped): step, row (index in `df`), position, token_id, entropy,
    role ("forking" / "reflection")."""
    if not 0 < top_frac <= 1:
        raise ValueError(f"top_frac must be in (0, 1], got {top_frac}")
    parts = []
    for row_index, row in df[df["entropy"].notna()].iterrows():
        roles = token_roles(row["loss_mask"], int(row["prompt_len"]), window)
        pos = np.flatnonzero(roles != NOT_MODEL)
        ent = np.asarray(row["entropy"], np.float32)
        pos = pos[pos < len(ent)]
        parts.append(pd.DataFrame({"step": row["step"], "row": row_index, "position": pos,
                                   "token_id": np.asarray(row["token_ids"])[pos], "entropy": ent[pos],
                                   "role": [ROLE_NAMES[r] for r in roles[pos]]}))
    if not parts:
        raise ValueError("no rollout has token entropies (they are written for rollouts kept by RoC)")
    tokens = pd.concat(parts, ignore_index=True)
    threshold = tokens.groupby("step")["entropy"].transform(lambda e: np.quantile(e, 1.0 - top_frac))
    return tokens[tokens["entropy"] >= threshold].reset_index(drop=True)


def role_shares(tokens: pd.DataFrame) -> pd.DataFrame:
    """Per step: how many high-entropy tokens, the share that are reflection tokens, and the mean
    entropy of each role."""
    g = tokens.groupby("step")
    out = pd.DataFrame({"tokens": g.size(), "reflection_share": g["role"].apply(lambda r: (r == "reflection").mean())})
    for name in ROLE_NAMES.values():
        out[f"{name}_entropy"] = tokens[tokens["role"] == name].groupby("step")["entropy"].mean()
    return out.reset_index()


def frequent_strings(tokens: pd.DataFrame, decode: Callable[[int], str], role: str | None = None,
                     k: int = 20) -> pd.DataFrame:
    """The `k` most frequent token strings (decode(token_id)) among `tokens` of `role` (all if
    None), with their count and share."""
    sel = tokens if role is None else tokens[tokens["role"] == role]
    counts = sel["token_id"].value_counts().head(k)
    return pd.DataFrame({"token": [repr(decode(int(t))) for t in counts.index], "token_id": counts.index,
                         "count": counts.values, "share": counts.values / max(len(sel), 1)})
