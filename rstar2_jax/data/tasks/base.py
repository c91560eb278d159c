"""What a task is (Task, TaskSpec), the registry `data.task` chooses from (TASKS), and
`register_task`, the decorator a task module registers its build function with."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Protocol, Sequence

from rstar2_jax.core.config_types import Section
from rstar2_jax.core.part_sections import NoSettings
from rstar2_jax.core.registry import Registry


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
    settings: type[Section]                               # its own section, data.<task>.*
    check: Callable[..., Iterable[tuple[str, str]]]       # data_cfg -> (field under data., message) of each problem
    has_sft_data: bool


TASKS: Registry[TaskSpec] = Registry("task")


def register_task(name: str, check: Callable[..., Iterable[tuple[str, str]]] = lambda data_cfg: (),
                  has_sft_data: bool = False, settings: type[Section] = NoSettings):
    def wrap(build):
        TASKS.register(name, TaskSpec(build, settings, check, has_sft_data))
        return build
    return wrap


def make_task(data_cfg, seed: int) -> Task:
    return TASKS[data_cfg.task].build(data_cfg, seed)
