"""Problem sets (a problem text and a gold answer per row) in the layouts public math-RL sets use.

Any storage `data/rows.py` reads (JSONL, Parquet, a datasets folder); the layout is told from the
first row's fields, in this order:

    rstar2_agent  verl rows written by the rStar2-Agent release (microsoft/rStar
                  data_preprocess/dapo_rstar2_agent_loop.py): extra_info.question / extra_info.answer,
                  the problem without the release's instruction template
    verl          verl's RL Parquet (docs/preparation/prepare_data.rst): `prompt` a list of chat
                  messages (the last user turn is the problem), reward_model.ground_truth the answer;
                  DAPO-Math-17k is stored so
    open_r1       open-r1/DAPO-Math-17k-Processed: `prompt` a string, `solution` the answer
    plain         problem|question|prompt|messages and answer|gold|final_answer (AIME, AMC, MATH-500
                  as JSONL); a MATH-style worked `solution` gives its last \\boxed{} as the answer

Anything else is read through a column mapping (data.problems.question_key, data.problems.answer_key, data.problems.id_key:
dotted paths into the row, e.g. "reward_model.ground_truth"), which also overrides the detection.
A row that does not fit its file's layout is an error naming file and row; a file whose layout is
unknown says which fields it found and which keys to set.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from rstar2_jax.data.jsonl import DataError
from rstar2_jax.data.rows import iter_rows
from rstar2_jax.rewards.answer import last_boxed

QUESTION_FIELDS = ("problem", "question", "prompt", "messages")
ANSWER_FIELDS = ("answer", "gold", "final_answer")
ID_FIELDS = ("id",)


@dataclasses.dataclass(frozen=True)
class MathProblem:
    id: str
    question: str
    answer: str


@dataclasses.dataclass(frozen=True)
class Columns:
    """Where a set keeps a row's fields: a dotted path each (a.b is row["a"]["b"])."""
    question: str = ""
    answer: str = ""
    id: str = ""


class _Missing:
    pass


MISSING = _Missing()


def field(row: Any, path: str) -> Any:
    """row["a"]["b"] for "a.b"; MISSING where any part is absent."""
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def chat_text(value: Any) -> str | None:
    """A problem text from a field: a string as it is, a chat (a list of {role, content}) as its last
    user turn's content; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return None


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    matches: Callable[[dict], bool]   # decided on a file's first row
    columns: Columns                  # where its fields are ("" for question: QUESTION_FIELDS)
    boxed_solution: bool = False      # the answer may be a worked solution: take its last \boxed{}


def _is_chat(value) -> bool:
    return chat_text(value) is not None and isinstance(value, list)


LAYOUTS = (
    Layout("rstar2_agent", lambda r: isinstance(field(r, "extra_info.question"), str)
           and field(r, "extra_info.answer") is not MISSING,
           Columns("extra_info.question", "extra_info.answer", "extra_info.index")),
    Layout("verl", lambda r: _is_chat(field(r, "prompt")) and field(r, "reward_model.ground_truth") is not MISSING,
           Columns("prompt", "reward_model.ground_truth", "extra_info.index")),
    Layout("open_r1", lambda r: isinstance(r.get("prompt"), str) and isinstance(r.get("solution"), str)
           and not any(k in r for k in ANSWER_FIELDS),
           Columns("prompt", "solution", "extra_info.index"), boxed_solution=True),
    # any of its fields: a row missing the other is then an error about that row, not about the layout
    Layout("plain", lambda r: any(k in r for k in (*QUESTION_FIELDS, *ANSWER_FIELDS, "solution")), Columns()),
)


def detect_layout(row: Any, path: str) -> Layout:
    if not isinstance(row, dict):
        raise DataError(f"{path}:1: expected an object (a row of named fields), got {type(row).__name__}")
    for layout in LAYOUTS:
        if layout.matches(row):
            return layout
    raise DataError(
        f"{path}: unknown problem-set layout; its first row has the fields {describe_fields(row)}. Known layouts: "
        f"{', '.join(x.name for x in LAYOUTS)}. Point the reader at yours with data.problems.question_key and "
        "data.problems.answer_key (dotted paths, e.g. --config.data.problems.question_key=input "
        "--config.data.problems.answer_key=reward_model.ground_truth)")


def describe_fields(row: dict, prefix: str = "") -> str:
    parts = []
    for k, v in row.items():
        if isinstance(v, dict) and not prefix:
            parts.append(f"{k}{{{describe_fields(v, k + '.')}}}")
        else:
            parts.append(f"{k} ({type(v).__name__})")
    return ", ".join(parts)


def _first(row: dict, names) -> Any:
    for name in names:
        value = field(row, name)
        if value is not MISSING and value is not None:
            return value
    return MISSING


def parse_row(row: Any, where: str, layout: Layout, columns: Columns) -> MathProblem:
    """One row as a problem; `columns` (the config's mapping) wins over the layout's own."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object (a row of named fields), got {type(row).__name__}")
    q_path = columns.question or layout.columns.question
    raw_q = field(row, q_path) if q_path else _first(row, [k for k in QUESTION_FIELDS if chat_text(row.get(k))])
    question = chat_text(raw_q) if raw_q is not MISSING else None
    if question is None:
        what = f"field {q_path!r}" if q_path else f"one of {QUESTION_FIELDS}"
        got = "missing" if raw_q is MISSING else f"a {type(raw_q).__name__}"
        raise DataError(f"{where}: no problem text: {what} is {got} (a string, or a chat list with a user turn)")
    a_path = columns.answer or layout.columns.answer
    from_solution = layout.boxed_solution and not columns.answer  # open_r1's `solution`: the answer, or boxed
    if a_path:
        answer = field(row, a_path)
    else:
        answer = _first(row, ANSWER_FIELDS)
        if answer is MISSING and isinstance(row.get("solution"), str):  # MATH-style: a worked solution
            answer = last_boxed(row["solution"])
            if answer is None:
                raise DataError(f"{where}: no answer field and no \\boxed{{}} answer in its solution")
    if answer is MISSING or answer is None:
        what = f"field {a_path!r}" if a_path else f"one of {ANSWER_FIELDS}, or a solution with \\boxed{{}}"
        raise DataError(f"{where}: no answer ({what})")
    if isinstance(answer, list) and len(answer) == 1:  # verl sets that store [ground_truth]
        answer = answer[0]
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DataError(f"{where}: the answer is a {type(answer).__name__}, expected a string or a number")
    if from_solution and isinstance(answer, str) and "\\boxed" in answer:
        answer = last_boxed(answer)
        if answer is None:
            raise DataError(f"{where}: the solution's \\boxed{{}} is not closed")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # AMC23 stores 27.0
    id_path = columns.id or layout.columns.id
    pid = field(row, id_path) if id_path else MISSING
    if pid is MISSING or pid is None:
        pid = _first(row, ID_FIELDS)
    return MathProblem("" if pid is MISSING or pid is None else str(pid), question, str(answer))


def load_problems(path: str | os.PathLike, limit: int | None = None,
                  columns: Columns = Columns()) -> list[MathProblem]:
    """The problems of a set (see the module docstring); ids default to the row number."""
    out = []
    layout = None
    for file, n, row in iter_rows(path, "problem file"):
        if layout is None:
            layout = _layout(row, file, columns)
        problem = parse_row(row, f"{file}:{n}", layout, columns)
        if not problem.id:
            problem = dataclasses.replace(problem, id=str(n) if file == os.fspath(path)
                                          else f"{os.path.basename(file)}:{n}")
        out.append(problem)
        if limit is not None and len(out) >= limit:
            break
    return out


def layout_of(path: str | os.PathLike, columns: Columns = Columns()) -> str:
    """The layout a set is read with, once its first row has been read with it (a set that cannot
    load says so here, before a run starts)."""
    return first_row_layout(first_row(path), columns).name


def first_row(path: str | os.PathLike) -> tuple[str, int, Any]:
    """(file, row number, row) of a set's first row; a set without rows is a DataError."""
    for located in iter_rows(path, "problem file"):
        return located
    raise DataError(f"{os.fspath(path)}: no rows")


def first_row_layout(located: tuple[str, int, Any], columns: Columns) -> Layout:
    """The layout of a set whose first row is `located`, that row read with it."""
    file, n, row = located
    layout = _layout(row, file, columns)
    parse_row(row, f"{file}:{n}", layout, columns)
    return layout


def _layout(row, file: str, columns: Columns) -> Layout:
    if columns.question and columns.answer:
        return MAPPED
    return detect_layout(row, file)


MAPPED = Layout("mapped", lambda r: True, Columns())
