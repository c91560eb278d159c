"""base.checked_prompt: the one `generate` prologue of every engine (issue 82)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rstar2_jax.rollout.engines.base import PromptTooLong, checked_prompt


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=50), st.integers(0, 100), st.integers(1, 60))
def test_the_budget_is_what_the_context_leaves_and_a_longer_prompt_is_refused(prompt, max_tokens, max_len):
    if len(prompt) > max_len:
        with pytest.raises(PromptTooLong):
            checked_prompt(prompt, max_tokens, max_len)
        return
    ids, budget = checked_prompt(prompt, max_tokens, max_len)
    assert ids == prompt and budget == min(max_tokens, max_len - len(prompt)) >= 0
    assert len(ids) + budget <= max_len


def test_no_limit_keeps_the_budget_and_an_empty_prompt_is_refused():
    assert checked_prompt((3, 4), 7, None) == ([3, 4], 7)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        checked_prompt([], 7, 10)
