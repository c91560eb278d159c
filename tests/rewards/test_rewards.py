"""Answer extraction, equivalence (math-verify + our normalisation), and RoC penalties."""

import time

import pytest
from hypothesis import given, strategies as st

from rstar2_jax.rewards import (answer_reward, choice_reward, chosen_option, extract_answer, format_penalty,
                                is_equivalent, tool_error_ratio)


@pytest.mark.parametrize("response,want", [
    ("<reason>x</reason><answer>so \\boxed{42}</answer>", "42"),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
    ("<answer>\\boxed{1}</answer> more <answer>final \\boxed{\\{a, b\\}}</answer>", "\\{a, b\\}"),
    ("<answer>\\boxed{1} then \\boxed{2}</answer>", "2"),
    ("\\boxed{5} but no answer block", None),
    ("<answer>no box</answer>", None),
    ("<answer>\\boxed{unclosed</answer>", None),
    ("<answer>\\boxed{x^{2}}</answer>", "x^{2}"),
])
def test_extract_answer(response, want):
    assert extract_answer(response) == want


EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"), ("\\dfrac{3}{4}", "\\frac34"), ("1+x", "x+1"), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("(1, 2)", "(1,2)"), ("\\pi/2", "\\frac{\\pi}{2}"), ("1/2^99", "2^{-99}"), ("x^2 - 1", "(x-1)(x+1)"),
    # what math-verify alone misses or what needs normalising
    ("007", "7"), ("025", "25"), ("1,000", "1000"), ("1,234,567", "1234567"), ("30^\\circ", "30"),
    ("30°", "30"), ("50\\%", "50"), ("10 \\text{ cm}", "10"), ("\\text{(B)}", "B"), ("(C)", "C"), ("d", "D"),
    ("\\boxed{12}", "12"), ("$12$", "12"), ("12.", "12"),
]
NOT_EQUIVALENT = [
    ("5, 6, 7", "7"), ("5, 6, 7", "5"), ("2", "3"), ("C", "B"), ("0.333", "\\frac{1}{3}"),
    ("1/2^99", "1/2^98"), ("", "1"), ("x+2", "x+1"), ("(A) and (B)", "A"),
]


@pytest.mark.parametrize("pred,gold", EQUIVALENT)
def test_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize("pred,gold", NOT_EQUIVALENT)
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


@pytest.mark.parametrize("pred", ["9^{9^{9^{9^{9^{9}}}}}", "{" * 5000 + "1" + "}" * 5000, "1" * 10_000_000],
                         ids=["power_tower", "deep_braces", "10_MB"])
def test_pathological_answers_cost_at_most_the_cap_and_score_zero(pred):
    start = time.monotonic()
    assert not is_equivalent(pred, "1")
    assert time.monotonic() - start < 7  # cap 5 s + worker restart
    assert is_equivalent("0.5", "\\frac{1}{2}")  # the worker is still usable afterwards


# Gold answers in the styles the public sets use (MATH-500's LaTeX, AIME's zero padding, AMC's
# decimals): each must reward itself when the model boxes it verbatim.
GOLD_STYLES = [
    "025", "7", "0", "-4", "\\frac{14}{3}", "\\frac14", "-\\frac{24}{25}", "\\dfrac{7}{2}", "\\sqrt{5}",
    "3\\sqrt{13}", "1+2\\sqrt{3}", "\\frac{\\sqrt{3}}{3}", "12\\pi", "\\frac{20000}{\\pi}", "55^\\circ",
    "864 \\mbox{ inches}^2", "5.4 \\text{ cents}", "\\text{(B)}", "\\text{Navin}", "(6,31,-1)",
    "\\left( 3, \\frac{\\pi}{2} \\right)", "\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]",
    "(-\\infty, 0]", "(2,\\infty)", "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "4343_6", "204_5",
    ".0000672", "326.5", "2.5", "x^3+3x-6", "6r^2-4r-24", "y = -2x", "1 - 12i", "1+274i", "10,\\!080", "58,500",
    "1\\frac{4}{5}", "137 \\frac{1}{2}", "\\$32,\\!348", "10\\%", "\\cot x", "3R^2", "\\{1, 2, 3\\}",
    "2, -2", "x \\in [-2,7]",
]


@pytest.mark.parametrize("gold", GOLD_STYLES)
def test_every_gold_answer_style_rewards_itself(gold):
    assert answer_reward(f"<reason>...</reason><answer>The answer is \\boxed{{{gold}}}.</answer>", gold) == 1.0


def test_answer_reward_needs_the_answer_block():
    assert answer_reward("\\boxed{7}", "7") == 0.0
    assert answer_reward("<answer>\\boxed{7}</answer>", "7") == 1.0


@given(st.lists(st.sampled_from(["ok", "error", "timeout", "parse_error", "memory"]), max_size=20))
def test_tool_error_ratio_law(statuses):
    r = tool_error_ratio(statuses)
    if not statuses:
        assert r == 0.5
    else:
        assert 0 <= r <= 1 and r * len(statuses) == pytest.approx(sum(s != "ok" for s in statuses))


@given(answers=st.integers(0, 6), turns=st.integers(1, 10))
def test_format_penalty_law(answers, turns):
    text = "x" + "<answer>\\boxed{1}</answer>" * answers
    p = format_penalty(text, turns)
    assert p == (1.0 if answers == 0 else min(1.0, (answers - 1) / turns))


@pytest.mark.parametrize("answer, letter", [
    ("D", "D"), ("(D)", "D"), ("D.", "D"), ("D) 10^-4 eV", "D"), ("Option D", "D"), ("\\text{D}", "D"),
    ("\\text{(B)}", "B"), ("b", "B"), ("answer: C", "C"), ("Dopamine", None), ("10^-4 ev", None), ("", None),
])
def test_chosen_option_reads_the_leading_letter(answer, letter):
    assert chosen_option(answer) == letter


def test_choice_reward_grades_the_option_letter_of_the_last_answer_block():
    assert choice_reward("<answer>\\boxed{D. 10^-4 ev}</answer>", "D") == 1.0
    assert choice_reward("<answer>\\boxed{C}</answer>", "D") == 0.0
    assert choice_reward("<answer>\\boxed{10^-4 ev}</answer>", "D") == 0.0  # the option's text is not its letter
    assert choice_reward("\\boxed{D}", "D") == 0.0  # outside an <answer> block


def released_error_ratio(text, pattern=r'<tool_response>.*?</tool_response>'):
    """microsoft/rStar roc.py calc_error_ratio_penalty_weights.error_ratio, ported."""
    import re
    matches = re.findall(pattern, text, re.DOTALL)
    error_count = len([match for match in matches if 'error' in match.lower()])
    return 0.5 if len(matches) == 0 else error_count / len(matches)


def released_format_penalty(text):
    """microsoft/rStar roc.py calc_format_penalty_weights.answer_tag_repetition, ported."""
    import re
    answer_tags = ["<answer>", "</answer>"]
    if any(tag not in text for tag in answer_tags):
        return 1.0
    closed = len(re.findall(r'<answer>.*?</answer>', text, re.DOTALL))
    if any(text.count(tag) != closed for tag in answer_tags):
        return 1.0
    num_turns = len(re.findall(r'<\|im_start\|>assistant.*?<\|im_end\|>', text, re.DOTALL))
    if num_turns == 0:
        return 1.0
    return min((closed - 1) / num_turns, 1.0)


TOOL = "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"
RESPONSES = [
    "x</reason><answer>\\boxed{1}</answer><|im_end|>",                       # no tool, answer in turn 1
    "<tool_call>{}</tool_call><|im_end|>" + TOOL.format("42") + "ok<answer>\\boxed{42}</answer><|im_end|>",
    "<tool_call>{}</tool_call><|im_end|>" + TOOL.format("Traceback: NameError") + "<answer>1</answer><|im_end|>",
    "<tool_call>{}</tool_call><|im_end|>" + TOOL.format("ERROR? no") + "<answer>1</answer><answer>2</answer><|im_end|>",
    "<answer>1</answer><answer>2",                                              # unbalanced
    "<tool_call>{}</tool_call><|im_end|>" + TOOL.format("1") + "<tool_call>{}</tool_call><|im_end|>"
    + TOOL.format("Timeout error") + "<answer>a</answer><answer>b</answer><answer>c</answer><|im_end|>",
    "no answer at all",
    "",
]


@pytest.mark.parametrize("text", RESPONSES)
def test_release_penalties_are_the_released_functions(text):
    from rstar2_jax.rewards.penalties import release_error_ratio, release_format_penalty
    assert release_error_ratio(text) == released_error_ratio(text)
    assert release_format_penalty(text) == released_format_penalty(text)


@given(st.lists(st.sampled_from(["<answer>", "</answer>", "<tool_response>", "</tool_response>", "error", "x",
                                 "<|im_start|>assistant", "<|im_end|>", "\n"]), max_size=30))
def test_release_penalties_law(pieces):
    from rstar2_jax.rewards.penalties import release_error_ratio, release_format_penalty
    text = "".join(pieces)
    assert release_error_ratio(text) == released_error_ratio(text)
    assert release_format_penalty(text) == released_format_penalty(text)
