"""`data.task=problems`: problem sets from files (`data.problems.train_path`, `eval_path`): JSONL,
Parquet or a datasets folder, in the verl, open-r1, rStar2-Agent or plain layout, or any other
through `data.problems.question_key` / `answer_key` / `id_key` (data/problems.py). A set's own
instruction template is stripped or kept by `data.problems.instructions` (data/templates.py)."""

from __future__ import annotations

import dataclasses
import os

from absl import logging

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.data.jsonl import DataError
from rstar2_jax.data.problems import MISSING, Columns, describe_fields, first_row, first_row_layout, load_problems
from rstar2_jax.data.problems import field as field_of
from rstar2_jax.data.tasks.base import Task, register_task
from rstar2_jax.data.templates import INSTRUCTIONS, TemplateCount, apply_instructions, kept_template_warnings, recognise


@dataclasses.dataclass(frozen=True)
class ProblemSetSettings(Section):
    """`data.problems.*`: the problem sets' files and how their rows are read."""
    train_path: str = setting("", "the training set (JSONL, Parquet, a folder of Parquet shards, or a datasets "
                              "save_to_disk folder)")
    eval_path: str = setting("", "the evaluation set (same formats)")
    question_key: str = setting("", "the problem text's field, a dotted path (a chat list gives its last user turn); "
                                "'' = told from the layout")
    answer_key: str = setting("", "the gold answer's field, a dotted path (e.g. reward_model.ground_truth); '' = "
                              "told from the layout")
    id_key: str = setting("", "the problem id's field; '' = the layout's, else the row number")
    instructions: str = setting("strip", "a public set's own instruction template around a problem (DAPO-Math-17k, "
                                "verl's GSM8K/MATH, open-r1, rStar2-Agent; data/templates.py): strip (only the "
                                "prompt format instructs) | keep (the text as stored: grade the format it asks for "
                                "with data.answer_format)", choices=INSTRUCTIONS)

# Rows read to tell which templates a set uses, before a run starts (the whole set is counted when
# the task loads it).
TEMPLATE_SAMPLE_ROWS = 64


def columns_of(sets: ProblemSetSettings) -> Columns:
    """The column mapping of the problem sets' settings."""
    return Columns(sets.question_key, sets.answer_key, sets.id_key)


def _check_problem_sets(data_cfg):
    """Each set exists and its first row reads in a known layout (or through the mapping): a file
    that cannot load fails here, before anything starts."""
    sets = data_cfg.problems
    for field in ("train_path", "eval_path"):
        path = getattr(sets, field)
        if not path:
            yield f"problems.{field}", "must be set for the problems task (a JSONL, Parquet or datasets folder of problems)"
            continue
        if not os.path.exists(path):
            yield f"problems.{field}", f"no such file or folder {path!r}"
            continue
        try:
            located = first_row(path)
        except (DataError, OSError) as e:
            yield f"problems.{field}", str(e)
            continue
        yield from _check_mapping(sets, located)
        try:
            first_row_layout(located, columns_of(sets))
        except DataError as e:
            yield f"problems.{field}", str(e)


def _check_mapping(sets: ProblemSetSettings, located):
    """Each key of the column mapping names a field of the set's first row (problems under the key)."""
    file, _, row = located
    for key in ("question_key", "answer_key", "id_key"):
        value = getattr(sets, key)
        if value and field_of(row, value) is MISSING:
            yield f"problems.{key}", (f"{value!r} is not a field of {file}'s rows (a dotted path; the first row has "
                                      f"{describe_fields(row) if isinstance(row, dict) else type(row).__name__})")


@register_task("problems", check=_check_problem_sets, settings=ProblemSetSettings)
def problem_sets_task(data_cfg, seed: int) -> Task:
    del seed  # the files fix the problems; the trainer shuffles them per epoch
    sets = data_cfg.problems

    def load(field: str, limit: int):
        problems = load_problems(getattr(sets, field), limit or None, columns_of(sets))
        count = TemplateCount.of(p.question for p in problems)
        logging.warning("data.problems.%s: %s; instructions=%s", field, count.describe(), sets.instructions)
        return [dataclasses.replace(p, question=apply_instructions(p.question, sets.instructions)) for p in problems]

    return Task(data_cfg.task, load("train_path", data_cfg.train_problems), load("eval_path", data_cfg.eval_problems))


def kept_template_conflicts(data_cfg, prompt_format: str = "", prompt_asks: str = "") -> list[str]:
    """Warnings: a set keeps a recognised template (instructions=keep) that asks for another answer
    format than the run grades, or than the prompt format `prompt_format` asks for itself
    (`prompt_asks`; told from the sets' first rows; nothing read if the files cannot load)."""
    if data_cfg.task != "problems" or data_cfg.problems.instructions != "keep":
        return []
    out = []
    for field in ("train_path", "eval_path"):
        path = getattr(data_cfg.problems, field)
        try:
            problems = load_problems(path, TEMPLATE_SAMPLE_ROWS, columns_of(data_cfg.problems))
        except (DataError, OSError):
            continue  # the check names what is wrong with the file
        names = {name for name, _ in map(recognise, (p.question for p in problems)) if name is not None}
        out += kept_template_warnings(names, path, data_cfg.answer_format, prompt_format, prompt_asks)
    return list(dict.fromkeys(out))  # the same file as both sets: once
