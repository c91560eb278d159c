"""Problem-set loading from the shared benchmark files, and clear errors for bad lines."""

import os

import pytest

from rstar2_jax.data.problems import DataError, load_problems

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


@pytest.mark.parametrize("name,rows", [("aime24", 30), ("aime25", 30), ("math_500", 500), ("amc23", 40)])
def test_shared_benchmarks_load(name, rows):
    problems = load_problems(os.path.join(DATA, f"{name}.jsonl"))
    assert len(problems) == rows and all(p.question and p.answer for p in problems)


def test_amc_float_answers_become_integers():
    assert load_problems(os.path.join(DATA, "amc23.jsonl"))[0].answer == "27"


@pytest.mark.parametrize("content,message", [
    ('{"problem": "x", "answer": 1}\n{oops}\n', r"bad.jsonl:2: invalid JSON"),
    ('{"problem": "x"}\n', r"bad.jsonl:1: no answer"),
    ('{"answer": 3}\n', r"bad.jsonl:1: no problem text"),
    ('[1, 2]\n', r"bad.jsonl:1: expected a JSON object"),
])
def test_bad_lines_name_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        load_problems(tmp_path / "bad.jsonl")
