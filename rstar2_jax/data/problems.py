"""Problem sets from JSONL (one object per line with a problem text and a gold answer).

Field names vary between public sets ("problem"/"question", "answer"/"gold"...); the reader takes
the first present of each list. HF-style sets with only a worked `solution` get the last
\\boxed{} of the solution as their answer. A malformed line is an error naming file and line.
"""

from __future__ import annotations

import dataclasses
import os

from rstar2_jax.data.jsonl import DataError, iter_jsonl
from rstar2_jax.rewards.answer import last_boxed

QUESTION_FIELDS = ("problem", "question", "prompt")
ANSWER_FIELDS = ("answer", "gold", "final_answer")


@dataclasses.dataclass(frozen=True)
class MathProblem:
    id: str
    question: str
    answer: str


def load_problems(path: str | os.PathLike, limit: int | None = None) -> list[MathProblem]:
    out = []
    for path, lineno, row in iter_jsonl(path, "problem file"):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object")
        question = next((row[k] for k in QUESTION_FIELDS if isinstance(row.get(k), str)), None)
        answer = next((row[k] for k in ANSWER_FIELDS if row.get(k) is not None), None)
        if question is None:
            raise DataError(f"{path}:{lineno}: no problem text (one of {QUESTION_FIELDS})")
        if answer is None and isinstance(row.get("solution"), str):
            answer = last_boxed(row["solution"])
            if answer is None:
                raise DataError(f"{path}:{lineno}: no answer field and no \\boxed{{}} answer in its solution")
        if answer is None:
            raise DataError(f"{path}:{lineno}: no answer (one of {ANSWER_FIELDS}, or a solution with \\boxed{{}})")
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)  # AMC23 stores 27.0
        out.append(MathProblem(str(row.get("id", lineno)), question, str(answer)))
        if limit is not None and len(out) >= limit:
            break
    return out
