"""Rewards: answer extraction, equivalence, and the RoC penalties. Depends on nothing of ours."""

from rstar2_jax.rewards.answer import chosen_option, extract_answer, normalize
from rstar2_jax.rewards.answer_formats import ANSWER_FORMATS, DEFAULT_ANSWER_FORMAT, Grade, Grader
from rstar2_jax.rewards.equivalence import is_equivalent, set_verify_limits
from rstar2_jax.rewards.penalties import format_penalty, tool_error_ratio


def answer_reward(response: str, gold: str) -> float:
    """1.0 if the \\boxed{} answer of the last <answer> block is equivalent to `gold`, else 0.0."""
    return Grader()(response, gold).reward


def choice_reward(response: str, gold_letter: str) -> float:
    """Multiple choice (GPQA-Diamond): 1.0 if the \\boxed{} answer of the last <answer> block
    picks the gold option letter, else 0.0."""
    return Grader(multiple_choice=True)(response, gold_letter).reward


__all__ = ["ANSWER_FORMATS", "DEFAULT_ANSWER_FORMAT", "Grade", "Grader", "answer_reward", "choice_reward",
           "chosen_option", "extract_answer", "format_penalty", "is_equivalent", "normalize", "set_verify_limits",
           "tool_error_ratio"]
