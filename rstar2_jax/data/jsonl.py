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
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield path, lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
