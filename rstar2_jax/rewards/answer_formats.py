"""Answer formats: where a response gives its final answer, read as the format's source reads it.

A run grades one format (`data.answer_format`), an evaluation one per benchmark (`evaluate
--answer_format`). A response with no answer in the expected format scores 0 and is a format
failure (`Grade.answer is None`), counted apart from wrong answers (`format_failure_rate`).

    answer_boxed   the \\boxed{} of the last <answer>...</answer> block: the rStar2-Agent prompt's
                   (its user template asks for it; rollout/prompt.py)
    boxed          the last \\boxed{} (or \\fbox{}) anywhere, as verl's reward_score/math.py
                   (`last_boxed_only_string` + `remove_boxed`) and open-r1's template ask
    dapo           the last "Answer: ..." line in the response's last 300 characters, as verl's
                   reward_score/math_dapo.py (`compute_score` -> `is_correct_minerva`) reads it
    gsm8k          the last "#### <number>" in the last 300 characters, commas and $ dropped, as
                   verl's reward_score/gsm8k.py (`extract_solution`, method "strict") reads it
    choice_letter  the letter of the first "Answer: X" (A-D), as openai/simple-evals reads GPQA
                   (common.py ANSWER_PATTERN_MULTICHOICE with gpqa_eval.py's re.search)

Extraction follows the source; comparison is ours for every format (rewards/equivalence.py,
math-verify plus normalisation, or the option letter for multiple choice), so formats differ only
in where the answer is read. Sources at the commits tests/rewards/test_answer_formats.py names.
A new format is one `ANSWER_FORMATS.register(name, AnswerFormat(...))`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from rstar2_jax.core.registry import Registry
from rstar2_jax.rewards.answer import chosen_option, extract_answer, last_boxed
from rstar2_jax.rewards.equivalence import is_equivalent


@dataclasses.dataclass(frozen=True)
class AnswerFormat:
    extract: Callable[[str], "str | None"]   # the answer a response gives in this format; None: none
    asks: str                                # what it asks of a response, for messages and docs


ANSWER_FORMATS: Registry[AnswerFormat] = Registry("answer format")

# verl reads the DAPO and GSM8K answers from the response's tail only ("the final answer is
# usually at the end"): an answer line earlier in a long response is not read, by them or by us.
VERL_TAIL_CHARS = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_SIMPLE_EVALS_CHOICE = re.compile(r"(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?")


def dapo_answer(response: str) -> str | None:
    found = _DAPO_ANSWER.findall(response[-VERL_TAIL_CHARS:])
    return found[-1].strip() if found else None


def gsm8k_answer(response: str) -> str | None:
    found = _GSM8K_ANSWER.findall(response[-VERL_TAIL_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def choice_letter_answer(response: str) -> str | None:
    found = _SIMPLE_EVALS_CHOICE.search(response)
    return found.group(1) if found else None


ANSWER_FORMATS.register("answer_boxed", AnswerFormat(extract_answer, "<answer>...\\boxed{ANSWER}...</answer>"))
ANSWER_FORMATS.register("boxed", AnswerFormat(last_boxed, "\\boxed{ANSWER}"))
ANSWER_FORMATS.register("dapo", AnswerFormat(dapo_answer, "a last line 'Answer: ANSWER'"))
ANSWER_FORMATS.register("gsm8k", AnswerFormat(gsm8k_answer, "'#### NUMBER'"))
ANSWER_FORMATS.register("choice_letter", AnswerFormat(choice_letter_answer, "'Answer: LETTER' (A-D)"))

DEFAULT_ANSWER_FORMAT = "answer_boxed"


@dataclasses.dataclass(frozen=True)
class Grade:
    reward: float             # 1.0 right, 0.0 otherwise
    answer: str | None        # what the response answered in the expected format; None: nothing

    @property
    def format_failure(self) -> bool:
        return self.answer is None


@dataclasses.dataclass(frozen=True)
class Grader:
    """grade(response, gold) in one answer format; `multiple_choice`: gold is an option letter."""
    format: str = DEFAULT_ANSWER_FORMAT
    multiple_choice: bool = False

    def __post_init__(self):
        ANSWER_FORMATS[self.format]  # an unknown name fails here, listing the known ones

    def __call__(self, response: str, gold: str) -> Grade:
        answer = ANSWER_FORMATS[self.format].extract(response)
        if answer is None:
            return Grade(0.0, None)
        if self.multiple_choice:
            right = chosen_option(answer) == gold.strip().upper()
        else:
            right = is_equivalent(answer, gold)
        return Grade(1.0 if right else 0.0, answer)
