"""Reading JSONL with errors that name the file and line."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator


class DataError(ValueError):
    """Malformed data; the message names file and line."""


def iter_jsonl(path: str | os.PathLike, what: str = "data file") -> Iterator[tuple[str, int, Any]]:
    """(path, line number, parsed object) for every non-empty line."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, "rb") as f:  # decoded line by line, so that bytes that are not UTF-8 name their line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (JSONL is one JSON object per line; is the file "
                                "Parquet or Arrow under another name?)") from None
            if not line.strip():
                continue
            try:
                yield path, lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None


def read_appended_jsonl(path: str | os.PathLike, what: str = "results file") -> list[Any]:
    """The rows of a JSONL file that a run appends to line by line (missing file: none). A last
    line cut short by a crash (no newline after it) is dropped, and cut from the file too, so the
    next append starts a fresh line; any other bad line is a DataError naming file and line."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines):  # the last line, without its newline: a write cut short
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text[:len(text) - len(line)])
                break
            raise DataError(f"{path}:{lineno}: invalid JSON in the {what} (remove the file to start "
                            "again)") from None
    return rows
