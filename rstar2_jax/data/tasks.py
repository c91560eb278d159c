"""Tasks: what an RL run trains and evaluates on, chosen by name with `data.task`.

A task gives the trainer problems (id, question, gold answer) for training and for evaluation,
and optionally synthetic SFT traces for a warm start. The trainer knows nothing else about it:

    "arith"  the CPU demo's synthetic multi-digit arithmetic (data/arith.py), with SFT traces
    "jsonl"  problem sets from JSONL files (data.train_path, data.eval_path; data/problems.py)

Add a task with `@register_task("name")` on a function (data_cfg, seed) -> Task, and give it a
`check` that names every bad field of `data.*` before anything runs ((field, message) pairs).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable, Protocol, Sequence

from rstar2_jax.config_types import Section, setting
from rstar2_jax.data.problems import load_problems
from rstar2_jax.registry import Registry


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
    build: Callable[..., Task]                            # (data_cfg, seed) -> Task
    check: Callable[..., Iterable[tuple[str, str]]]       # data_cfg -> (field, message) of each problem
    has_sft_data: bool


TASKS: Registry[TaskSpec] = Registry("task")


def register_task(name: str, check: Callable[..., Iterable[tuple[str, str]]] = lambda data_cfg: (),
                  has_sft_data: bool = False):
    def wrap(build):
        TASKS.register(name, TaskSpec(build, check, has_sft_data))
        return build
    return wrap


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    task: str = setting("arith", "what the run trains and evaluates on (arith: synthetic arithmetic, "
                        "jsonl: train_path / eval_path)", choices=TASKS)
    train_problems: int = setting(4000, "arith: how many; jsonl: the first N (0 = all)", min=0)
    eval_problems: int = setting(200, "arith: how many; jsonl: the first N (0 = all)", min=0)
    train_path: str = setting("", "jsonl task: problem/answer rows for training")
    eval_path: str = setting("", "jsonl task: problem/answer rows for evaluation")

    def rules(self):
        if self.task in TASKS:
            yield from TASKS[self.task].check(self)


def make_task(data_cfg: DataConfig, seed: int) -> Task:
    return TASKS[data_cfg.task].build(data_cfg, seed)


# ----------------------------------------------------------------------------------------------
def _check_arith(data_cfg):
    for field in ("train_problems", "eval_problems"):
        if getattr(data_cfg, field) <= 0:
            yield field, "must be > 0 for the arith task (it makes that many problems)"


@register_task("arith", has_sft_data=True, check=_check_arith)
def arith_task(data_cfg, seed: int) -> Task:
    from rstar2_jax.data import arith  # the demo task's code loads only when a run uses it
    return Task("arith", arith.make_problems(data_cfg.train_problems, seed=seed + 1),
                arith.make_problems(data_cfg.eval_problems, seed=10_000 + seed), sft_data=arith.sft_dataset)


def _check_jsonl(data_cfg):
    for field in ("train_path", "eval_path"):
        if not os.path.isfile(getattr(data_cfg, field)):
            yield field, f"no such file {getattr(data_cfg, field)!r} (a JSONL of problem/answer rows)"


@register_task("jsonl", check=_check_jsonl)
def jsonl_task(data_cfg, seed: int) -> Task:
    del seed  # the files fix the problems; the trainer shuffles them per epoch
    return Task("jsonl", load_problems(data_cfg.train_path, limit=data_cfg.train_problems or None),
                load_problems(data_cfg.eval_path, limit=data_cfg.eval_problems or None))
