"""Answer formats (rewards/answer_formats.py), each read as its source reads it, on that source's own
cases; the grader's format failures apart from wrong answers.

Sources (the extraction each format copies, at the commit read):
- `dapo`: verl verl/utils/reward_score/math_dapo.py @ 012542c4 (`compute_score` keeps the last 300
  characters; `is_correct_minerva` takes the last match of (?i)Answer\\s*:\\s*([^\\n]+), else
  "[INVALID]");
- `gsm8k`: verl verl/utils/reward_score/gsm8k.py, current (`_SOLUTION_CLIP_CHARS = 300`, strict:
  the last "#### (\\-?[0-9\\.\\,]+)", commas and $ removed; no match -> None);
- `boxed`: verl verl/utils/reward_score/math.py `last_boxed_only_string` + `remove_boxed` (the last
  \\boxed{...}, braces balanced);
- `choice_letter`: openai/simple-evals common.py @ 01ac108d ANSWER_PATTERN_MULTICHOICE
  (?i)Answer[ \\t]*:[ \\t]*\\$?([A-D])\\$? with gpqa_eval.py's re.search (the first match).
verl ships no unit tests of these readers; the cases below are the behaviours their code defines
(named per case). Comparison is ours for every format (math-verify + normalisation).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_jax.core.registry import UnknownNameError
from rstar2_jax.rewards import ANSWER_FORMATS, Grader

FILLER = "Let me work through this carefully. " * 12  # 432 characters of reasoning


@pytest.mark.parametrize("response,answer", [
    ("Some steps.\nAnswer: 42", "42"),                          # the form DAPO's template asks for
    ("answer:   7/3", "7/3"),                                    # (?i), \s* after the colon
    ("Answer: 1\nthen I checked again.\nAnswer: 2", "2"),        # findall(...)[-1]: the last
    ("Answer: \\frac{1}{2} \nmore", "\\frac{1}{2}"),             # up to the line's end (stripped)
    ("The answer is 5.", None),                                  # no "Answer:": "[INVALID]" there
    ("Answer: 9\n" + FILLER, None),                              # before the last 300 characters
])
def test_dapo_reads_the_last_answer_line_in_the_tail_as_verl_math_dapo(response, answer):
    assert ANSWER_FORMATS["dapo"].extract(response) == answer


@pytest.mark.parametrize("response,answer", [
    ("So she pays 18 dollars.\n#### 18", "18"),
    ("#### 1,234", "1234"),                                      # commas removed
    ("#### -3.5", "-3.5"),
    ("#### 1\nno wait\n#### 2", "2"),                            # findall(...)[-1]: the last
    ("####18", None),                                            # strict: "#### " with its space
    ("The answer is 18.", None),
    ("#### 4\n" + FILLER, None),                                 # before the last 300 characters
])
def test_gsm8k_reads_the_last_hash_answer_as_verl_gsm8k_strict(response, answer):
    assert ANSWER_FORMATS["gsm8k"].extract(response) == answer


@pytest.mark.parametrize("response,answer", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),                # braces balanced
    ("\\boxed{1} then \\boxed{2}", "2"),                         # the last
    ("<answer>\\boxed{3}</answer>", "3"),                        # inside tags too: it is a \boxed{}
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_boxed_reads_the_last_box_as_verl_math(response, answer):
    assert ANSWER_FORMATS["boxed"].extract(response) == answer


@pytest.mark.parametrize("response,answer", [
    ("reasoning...\nAnswer: B", "B"),
    ("answer:$C$", "C"),                                         # (?i) and the optional $ ... $
    ("Answer: A\nActually no.\nAnswer: D", "A"),                 # re.search: the first
    ("Answer: E", None),                                         # A-D only
    ("Answer:\nB", None),                                        # [ \t]*: not across a line
])
def test_choice_letter_reads_as_simple_evals_gpqa(response, answer):
    assert ANSWER_FORMATS["choice_letter"].extract(response) == answer


# A correct response written the way each format asks (what a model following that instruction writes)
WRITE = {
    "answer_boxed": lambda a: f"<reason>work</reason><answer>The answer is \\boxed{{{a}}}.</answer>",
    "boxed": lambda a: f"Step by step... so the result is \\boxed{{{a}}}.",
    "dapo": lambda a: f"Step by step...\nAnswer: {a}",
    "gsm8k": lambda a: f"Step by step...\n#### {a}",
}


@given(st.sampled_from(sorted(WRITE)), st.integers(-10**6, 10**6))
def test_a_correct_answer_in_a_format_scores_1_in_that_format(fmt, gold):
    grade = Grader(fmt)(WRITE[fmt](gold), str(gold))
    assert grade.reward == 1.0 and not grade.format_failure and grade.answer == str(gold)


# Graded in another format, a response has no answer there: 0 and a format failure, not a wrong
# answer. Except where one format reads the other's: an <answer>\boxed{}</answer> response is a
# \boxed{} too, so `boxed` reads it (listed, and checked to score 1).
READS_OTHERS = {("answer_boxed", "boxed")}


@pytest.mark.parametrize("written", sorted(WRITE))
@pytest.mark.parametrize("graded", sorted(WRITE))
def test_a_correct_answer_in_another_format_is_a_format_failure(written, graded):
    grade = Grader(graded)(WRITE[written]("17"), "17")
    if written == graded or (written, graded) in READS_OTHERS:
        assert grade.reward == 1.0 and not grade.format_failure
    else:
        assert grade.reward == 0.0 and grade.format_failure and grade.answer is None


def test_a_wrong_answer_in_the_format_is_wrong_not_a_format_failure():
    grade = Grader("dapo")("Answer: 16", "17")
    assert grade.reward == 0.0 and not grade.format_failure and grade.answer == "16"


def test_multiple_choice_grades_the_option_letter_in_either_format():
    assert Grader("choice_letter", multiple_choice=True)("...\nAnswer: C", "C").reward == 1.0
    assert Grader("choice_letter", multiple_choice=True)("...\nAnswer: B", "C").reward == 0.0
    assert Grader(multiple_choice=True)("<answer>\\boxed{C}</answer>", "C").reward == 1.0
    failed = Grader("choice_letter", multiple_choice=True)("<answer>\\boxed{C}</answer>", "C")
    assert failed.format_failure and failed.reward == 0.0


def test_an_unknown_answer_format_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="unknown answer format 'dapo_line'.*answer_boxed, boxed, choice_letter"):
        Grader("dapo_line")
