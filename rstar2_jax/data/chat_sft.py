"""Chat / tool-call JSONL for SFT: {"messages": [{"role", "content"}, ...], "tools": [...]?} per line.

Each conversation is rendered with the model's own chat template, message by message, so the
tokens are exactly what the template produces; the loss mask is 1 on assistant content (and its
end-of-turn token) and 0 on everything else, role headers included.
"""

from __future__ import annotations

import os

from rstar2_jax.data.jsonl import DataError, iter_jsonl

ROLES = ("system", "user", "assistant", "tool")


def load_conversations(path: str | os.PathLike) -> list[dict]:
    out = []
    for file, lineno, row in iter_jsonl(path, "SFT data"):
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{file}:{lineno}: expected a non-empty 'messages' list")
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content", ""), str):
                raise DataError(f"{file}:{lineno}: each message needs a role in {ROLES} and string content")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{file}:{lineno}: no assistant message to learn from")
        out.append(row)
    return out


def tokenize_conversation(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    messages, tools = row["messages"], row.get("tools")
    ids, mask, prev = [], [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            header = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True)
            _extend(tokenizer, ids, mask, header, prev, 0)
            prev = header
        text = tokenizer.apply_chat_template(messages[:i + 1], tools=tools)
        _extend(tokenizer, ids, mask, text, prev, 1 if message["role"] == "assistant" else 0)
        prev = text
    return ids, mask


def _extend(tokenizer, ids, mask, text, prev, value):
    if not text.startswith(prev):
        raise DataError("the chat template does not render conversations incrementally; cannot build masks")
    piece = tokenizer.encode(text[len(prev):])
    ids += piece
    mask += [value] * len(piece)
