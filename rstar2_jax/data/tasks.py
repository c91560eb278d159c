"""Tasks: what an RL run trains and evaluates on, chosen by name with `data.task`.

A task gives the trainer problems (id, question, gold answer) for training and for evaluation,
and optionally synthetic SFT traces for a warm start. The trainer knows nothing else about it:

    "arith"  the CPU demo's synthetic multi-digit arithmetic (data/arith.py), with SFT traces
    "jsonl"  problem sets from JSONL files (data.train_path, data.eval_path; data/problems.py)

Add a task with `@register_task("name")` on a function (data_cfg, seed) -> Task, and give it a
`check` that names every bad field before anything runs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Protocol, Sequence

from rstar2_jax.data import arith
from rstar2_jax.data.problems import load_problems


class Problem(Protocol):
    id: str
    question: str
    answer: str


# (tokenizer, prompt format, number of examples, seed) -> [(token_ids, loss_mask)]
SFTData = Callable[..., list[tuple[list[int], list[int]]]]


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    train_problems: Sequence[Problem]
    eval_problems: Sequence[Problem]
    sft_data: SFTData | None = None     # synthetic SFT traces; None: warm-start elsewhere (python -m rstar2_jax.sft)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    build: Callable[..., Task]              # (data_cfg, seed) -> Task
    check: Callable[..., list[str]]         # data_cfg -> what is wrong with it ([] when fine)
    has_sft_data: bool


TASKS: dict[str, TaskSpec] = {}


def register_task(name: str, check: Callable[..., list[str]] = lambda data_cfg: [], has_sft_data: bool = False):
    def wrap(build):
        if name in TASKS:
            raise ValueError(f"task {name!r} is registered twice")
        TASKS[name] = TaskSpec(build, check, has_sft_data)
        return build
    return wrap


def check_task(data_cfg) -> list[str]:
    if data_cfg.task not in TASKS:
        return [f"data.task must be one of {sorted(TASKS)}, got {data_cfg.task!r}"]
    return TASKS[data_cfg.task].check(data_cfg)


def make_task(data_cfg, seed: int) -> Task:
    problems = check_task(data_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    return TASKS[data_cfg.task].build(data_cfg, seed)


# ----------------------------------------------------------------------------------------------
@register_task("arith", has_sft_data=True,
               check=lambda d: [] if d.train_problems > 0 and d.eval_problems > 0 else
               ["data.train_problems and data.eval_problems must be > 0 for the arith task"])
def arith_task(data_cfg, seed: int) -> Task:
    return Task("arith", arith.make_problems(data_cfg.train_problems, seed=seed + 1),
                arith.make_problems(data_cfg.eval_problems, seed=10_000 + seed), sft_data=arith.sft_dataset)


def _check_jsonl(data_cfg) -> list[str]:
    return [f"data.{field}: no such file {getattr(data_cfg, field)!r} (a JSONL of problem/answer rows)"
            for field in ("train_path", "eval_path") if not os.path.isfile(getattr(data_cfg, field))]


@register_task("jsonl", check=_check_jsonl)
def jsonl_task(data_cfg, seed: int) -> Task:
    del seed  # the files fix the problems; the trainer shuffles them per epoch
    return Task("jsonl", load_problems(data_cfg.train_path, limit=data_cfg.train_problems or None),
                load_problems(data_cfg.eval_path, limit=data_cfg.eval_problems or None))
