"""Problem sets (a problem text and a gold answer per row) in the layouts public math-RL sets use.

Any storage `data/rows.py` reads (JSONL, Parquet, a datasets folder). The layout is told from what
the first row is, not only from which keys it has; the most specific layout that fits wins, and
the loader logs which it chose and why:

    rstar2_agent   the rStar2-Agent release's verl rows (microsoft/rStar
                   data_preprocess/dapo_rstar2_agent_loop.py): agent_name "rstar2_agent", or
                   extra_info.answer equal to reward_model.ground_truth; the problem without the
                   release's instruction template in extra_info.question
    verl_gsm8k     verl's GSM8K preprocessing (examples/data_preprocess/gsm8k.py): data_source
                   "openai/gsm8k", or extra_info.answer a worked solution ending "#### N"; the gold
                   is reward_model.ground_truth, the problem the user turn with verl's instruction
    verl_math      verl's MATH preprocessing (math_dataset.py): data_source MATH-lighteval, or
                   verl's boxed instruction
    dapo_math_17k  DAPO-Math-17k (verl's RL Parquet, data_source "math_dapo" or its template)
    verl           any other verl RL Parquet (docs/preparation/prepare_data.rst): `prompt` a list of
                   chat messages (the last user turn is the problem), reward_model.ground_truth the gold
    open_r1        open-r1/DAPO-Math-17k-Processed: `prompt` a string, `solution` the answer
    gsm8k          openai/gsm8k as published: question, answer "<worked solution>\n#### N" (gold N)
    plain          problem|question|prompt|messages and answer|gold|final_answer (AIME, AMC, MATH-500
                   as JSONL); a MATH-style worked `solution` gives its last \\boxed{} as the answer

A gold is a final answer, never a worked solution: one with several lines, a "####" or a \\boxed{}
in it is refused, naming file, row and the key to set. A row two layouts would read with different
golds (verl's ground_truth and the release's extra_info.answer disagreeing) is refused as ambiguous.
Anything else is read through a column mapping (data.problems.question_key, data.problems.answer_key, data.problems.id_key:
dotted paths into the row, e.g. "reward_model.ground_truth"), which also overrides the detection.
A row that does not fit its file's layout is an error naming file and row; a file whose layout is
unknown says which fields it found and which keys to set.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

from absl import logging

from rstar2_jax.data.jsonl import DataError
from rstar2_jax.data.rows import iter_rows
from rstar2_jax.data.templates import TEMPLATES, recognise
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
    evidence: Callable[[dict], "str | None"]  # why a row is in this layout (a file's first row decides); None: not
    columns: Columns                  # where its fields are ("" for question: QUESTION_FIELDS)
    boxed_solution: bool = False      # the answer may be a worked solution: take its last \boxed{}
    final_answer: Callable[[str], "str | None"] | None = None  # the gold inside a stored worked answer
    template: str = ""                # the instruction template its problem texts carry (data/templates.py)

    def matches(self, row: dict) -> bool:
        return self.evidence(row) is not None


def _is_chat(value) -> bool:
    return chat_text(value) is not None and isinstance(value, list)


def _verl_shaped(row: dict) -> bool:
    """verl's RL row: `prompt` a chat, reward_model.ground_truth the gold."""
    return _is_chat(field(row, "prompt")) and field(row, "reward_model.ground_truth") is not MISSING


def _source(row: dict) -> str:
    source = row.get("data_source")
    return source if isinstance(source, str) else ""


def _same_answer(a, b) -> bool:
    unwrap = (lambda v: v[0] if isinstance(v, list) and len(v) == 1 else v)
    return str(unwrap(a)).strip() == str(unwrap(b)).strip()


def _user_template(row: dict) -> str | None:
    return recognise(chat_text(field(row, "prompt")) or "")[0]


def gsm8k_final_answer(answer: str) -> str | None:
    """GSM8K's gold inside its worked answer ("... #### 1,234" -> "1234"), as verl's gsm8k.py
    preprocessing takes it (extract_solution: the number after "#### ", commas dropped)."""
    found = _GSM8K_GOLD.search(answer)
    return found.group(1).replace(",", "") if found else None


_GSM8K_GOLD = re.compile(r"#### (\-?[0-9\.\,]+)")


def _rstar2_agent(row):
    if not isinstance(field(row, "extra_info.question"), str) or field(row, "extra_info.answer") is MISSING:
        return None
    if row.get("agent_name") == "rstar2_agent":
        return "agent_name 'rstar2_agent' with extra_info.question and extra_info.answer"
    truth = field(row, "reward_model.ground_truth")
    if truth is MISSING:
        return "extra_info.question and extra_info.answer, no reward_model.ground_truth"
    if _same_answer(truth, field(row, "extra_info.answer")):
        return "extra_info.question, and extra_info.answer equal to reward_model.ground_truth"
    return None


def _verl_gsm8k(row):
    if not _verl_shaped(row):
        return None
    if _source(row) == "openai/gsm8k":
        return "verl's GSM8K preprocessing: data_source 'openai/gsm8k', the gold in reward_model.ground_truth"
    worked = field(row, "extra_info.answer")
    if isinstance(worked, str) and gsm8k_final_answer(worked) is not None:
        return ("verl's GSM8K preprocessing: extra_info.answer is a worked solution ending in '#### N', the gold in "
                "reward_model.ground_truth")
    return None


MATH_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH")  # verl math_dataset.py, newer and older


def _verl_math(row):
    if not _verl_shaped(row):
        return None
    if _source(row) in MATH_SOURCES:
        return f"verl's MATH preprocessing: data_source {_source(row)!r}"
    if _user_template(row) == "verl_math":
        return "verl's MATH preprocessing: the user turn ends with its instruction"
    return None


def _dapo_math_17k(row):
    if not _verl_shaped(row):
        return None
    if _source(row) == "math_dapo":
        return "DAPO-Math-17k: data_source 'math_dapo'"
    if _user_template(row) == "dapo_math_17k":
        return "DAPO-Math-17k: the user turn is in its instruction template"
    return None


def _verl(row):
    if not _verl_shaped(row):
        return None
    question, answer = field(row, "extra_info.question"), field(row, "extra_info.answer")
    truth = field(row, "reward_model.ground_truth")
    if isinstance(question, str) and answer is not MISSING and not worked_solution(str(answer)) \
            and not _same_answer(answer, truth):
        raise AmbiguousLayout(f"two golds that differ: reward_model.ground_truth={str(truth)[:60]!r} (verl's) and "
                              f"extra_info.answer={str(answer)[:60]!r} (the rStar2-Agent release's)",
                              "data.problems.answer_key=reward_model.ground_truth (or extra_info.answer) and "
                              "data.problems.question_key=prompt (or extra_info.question)")
    return "verl's RL Parquet: prompt a chat, the gold in reward_model.ground_truth"


def _open_r1(row):
    if isinstance(row.get("prompt"), str) and isinstance(row.get("solution"), str) \
            and not any(k in row for k in ANSWER_FIELDS):
        return "open-r1: prompt a string, the gold in solution (its last \\boxed{} where it is a worked one)"
    return None


def _gsm8k(row):
    if isinstance(row.get("question"), str) and isinstance(row.get("answer"), str) \
            and gsm8k_final_answer(row["answer"]) is not None and "\n" in row["answer"]:
        return "openai/gsm8k: question, and an answer that is a worked solution ending in '#### N'"
    return None


def _plain(row):
    # any of its fields: a row missing the other is then an error about that row, not about the layout
    found = [k for k in (*QUESTION_FIELDS, *ANSWER_FIELDS, "solution") if k in row]
    return f"plain: the fields {', '.join(found)}" if found else None


class AmbiguousLayout(DataError):
    """A row two layouts read with different golds: the user says which (the keys to set)."""

    def __init__(self, why: str, keys: str):
        super().__init__(why)
        self.why, self.keys = why, keys


# Most specific first: a row the first matching layout reads. Public sets' sources:
#   rstar2_agent   microsoft/rStar data_preprocess/dapo_rstar2_agent_loop.py
#   verl_gsm8k     verl examples/data_preprocess/gsm8k.py (extra_info.answer is the worked solution)
#   verl_math      verl examples/data_preprocess/math_dataset.py
#   dapo_math_17k  BytedTsinghua-SIA/DAPO-Math-17k (verl's RL Parquet, data_source "math_dapo")
#   verl           any other verl RL Parquet (docs/preparation/prepare_data.rst)
#   open_r1        open-r1/DAPO-Math-17k-Processed
#   gsm8k          openai/gsm8k as published (question, answer "...#### N")
#   plain          problem|question|prompt|messages with answer|gold|final_answer (AIME, AMC, MATH-500)
_VERL_COLUMNS = Columns("prompt", "reward_model.ground_truth", "extra_info.index")
LAYOUTS = (
    Layout("rstar2_agent", _rstar2_agent, Columns("extra_info.question", "extra_info.answer", "extra_info.index"),
           template="rstar2_agent"),
    Layout("verl_gsm8k", _verl_gsm8k, _VERL_COLUMNS, template="verl_gsm8k"),
    Layout("verl_math", _verl_math, _VERL_COLUMNS, template="verl_math"),
    Layout("dapo_math_17k", _dapo_math_17k, _VERL_COLUMNS, template="dapo_math_17k"),
    Layout("verl", _verl, _VERL_COLUMNS),
    Layout("open_r1", _open_r1, Columns("prompt", "solution", "extra_info.index"), boxed_solution=True),
    Layout("gsm8k", _gsm8k, Columns("question", "answer"), final_answer=gsm8k_final_answer),
    Layout("plain", _plain, Columns()),
)


def worked_solution(answer: str) -> str | None:
    """Why a gold answer looks like a worked solution rather than a final answer (several lines, a
    GSM8K "####", a \\boxed{} inside it); None when it looks like an answer."""
    if "####" in answer:
        return "it holds a GSM8K '####' line"
    if "\\boxed" in answer or "\\fbox" in answer:
        return "it holds a \\boxed{}"
    if answer.strip().count("\n") >= 2:
        return f"it runs over {answer.strip().count(chr(10)) + 1} lines"
    return None


def decide_layout(row: Any, path: str, n: int = 1) -> tuple[Layout, str]:
    """(the layout of a file whose row `n` is `row`, the evidence for it)."""
    if not isinstance(row, dict):
        raise DataError(f"{path}:{n}: expected an object (a row of named fields), got {type(row).__name__}")
    for layout in LAYOUTS:
        try:
            evidence = layout.evidence(row)
        except AmbiguousLayout as e:
            raise DataError(f"{path}:{n}: ambiguous layout: {e.why}. Say which to read with {e.keys}") from None
        if evidence is not None:
            return layout, evidence
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
    if layout.final_answer is not None and not columns.answer and isinstance(answer, str):
        answer = layout.final_answer(answer) or answer  # none found: refused below as a worked solution
    why = worked_solution(answer) if isinstance(answer, str) else None
    if why is not None:
        what = f"field {a_path!r}" if a_path else "its answer field"
        raise DataError(f"{where}: the gold ({what}) looks like a worked solution, not a final answer ({why}): "
                        f"{answer[:80]!r}... Point data.problems.answer_key at the field that holds the final "
                        "answer alone (e.g. reward_model.ground_truth in verl's rows)")
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
            layout, evidence = _layout(row, file, columns, n)
            # a warning only where the layout changes what the problems say (a kept instruction template)
            (logging.warning if layout.template else logging.info)(
                "%s: read as layout %s (%s)%s", file, layout.name, evidence, _template_note(layout))
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
    layout, _ = _layout(row, file, columns, n)
    parse_row(row, f"{file}:{n}", layout, columns)
    return layout


def _layout(row, file: str, columns: Columns, n: int = 1) -> tuple[Layout, str]:
    if columns.question and columns.answer:
        return MAPPED, f"the column mapping: question {columns.question!r}, answer {columns.answer!r}"
    return decide_layout(row, file, n)


def _template_note(layout: Layout) -> str:
    if not layout.template:
        return ""
    return (f"; its problems are written in {layout.template}'s instruction template (it asks for answer format "
            f"{TEMPLATES[layout.template].answer_format!r}; data.problems.instructions strips or keeps it)")


MAPPED = Layout("mapped", lambda r: "the column mapping", Columns())
