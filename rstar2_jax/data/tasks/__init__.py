"""Tasks: what an RL run trains and evaluates on, chosen by name with `data.task`.

A task gives the trainer problems (id, question, gold answer) for training and for evaluation,
and optionally synthetic SFT traces for a warm start. The trainer knows nothing else about it:

    "arith"  the CPU demo's synthetic multi-digit arithmetic (arith_task.py over data/arith.py), with SFT traces
    "problems"  problem sets from files (data.problems.train_path, eval_path): JSONL, Parquet or
             a datasets folder, in the verl, open-r1, rStar2-Agent or plain layout, or any other
             through data.problems.question_key / answer_key / id_key (problem_sets.py); "jsonl",
             its older name, is read as "problems" from an older run's config.json

Every task's rollouts are graded in `data.answer_format` (rewards/answer_formats.py); a problem
set's own instruction template is stripped or kept by `data.problems.instructions` (data/templates.py).

Add a task as a module here: `@register_task("name", settings=...)` (base.py) on a function
(data_cfg, seed) -> Task, with a `check` that names every bad field of `data.*` before anything
runs ((field, message) pairs), and its import below. Its settings appear as `data.<name>.*`.
"""

from __future__ import annotations

# Each task registers itself; this order is the choices' order in --helpconfig and the config.
from rstar2_jax.data.tasks import arith_task  # noqa: F401
from rstar2_jax.data.tasks import problem_sets  # noqa: F401
from rstar2_jax.core.config_types import setting
from rstar2_jax.data.tasks.base import TASKS, SFTData, Task, TaskSpec, make_task, register_task
from rstar2_jax.data.tasks.problem_sets import ProblemSetSettings, kept_template_conflicts
from rstar2_jax.core.part_sections import PartChoice, part_section
from rstar2_jax.rewards.answer_formats import ANSWER_FORMATS, DEFAULT_ANSWER_FORMAT

__all__ = ["DataConfig", "ProblemSetSettings", "SFTData", "TASKS", "Task", "TaskSpec", "kept_template_conflicts",
           "make_task", "register_task"]


class _DataBase(PartChoice):
    """`data.*`: the task (data.task), how many problems, and each task's own settings
    (data.<task>.*; only the chosen task's are read)."""

    @classmethod
    def upgrade_values(cls, mapping):
        if mapping.get("task") == "jsonl":  # the problems task's name before other formats were read
            mapping["task"] = "problems"
        problems = mapping.get("problems")
        if mapping.get("task") == "problems" and isinstance(problems, dict) and "instructions" not in problems:
            mapping["problems"] = {**problems, "instructions": "keep"}  # before templates were read: as stored
        return mapping


DataConfig = part_section(
    "DataConfig", TASKS, path="data", module=__name__, base=_DataBase, refuse_unchosen=False,
    moved={key: f"problems.{key}" for key in ("train_path", "eval_path", "question_key", "answer_key", "id_key")},
    selector=("task", str, setting("arith", "what the run trains and evaluates on (arith: synthetic arithmetic, "
                                   "problems: problem sets from data.problems.*)", choices=TASKS)),
    common=[("train_problems", int, setting(4000, "arith: how many; problems: the first N (0 = all)", min=0)),
            ("eval_problems", int, setting(200, "arith: how many; problems: the first N (0 = all)", min=0)),
            ("answer_format", str, setting(DEFAULT_ANSWER_FORMAT, "where a response's answer is read and graded "
                                           "(rewards/answer_formats.py): answer_boxed (the rstar2 and tiny prompt "
                                           "formats'), boxed, dapo, gsm8k, choice_letter",
                                           choices=ANSWER_FORMATS))])
