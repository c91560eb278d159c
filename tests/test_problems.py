"""Problem-set loading in the public benchmarks' formats, and clear errors for bad lines."""

import os

import pytest

from rstar2_jax.data.problems import DataError, load_problems
from tests.benchmark_files import ROWS


@pytest.mark.parametrize("name", ["aime24", "aime25", "math_500", "amc23"])
def test_benchmark_formats_load(benchmark_dir, name):
    problems = load_problems(os.path.join(benchmark_dir, f"{name}.jsonl"))
    rows = ROWS[f"{name}.jsonl"]
    assert [p.question for p in problems] == [r.get("problem", r.get("question")) for r in rows]
    assert all(p.answer for p in problems)


def test_answers_keep_their_text_and_integral_floats_become_integers(benchmark_dir):
    assert [p.answer for p in load_problems(os.path.join(benchmark_dir, "aime24.jsonl"))] == ["025", "231", "024"]
    assert [p.answer for p in load_problems(os.path.join(benchmark_dir, "aime25.jsonl"))] == ["56", "24"]
    assert [p.answer for p in load_problems(os.path.join(benchmark_dir, "amc23.jsonl"))] == ["27", "2.5"]


@pytest.mark.parametrize("content,message", [
    ('{"problem": "x", "answer": 1}\n{oops}\n', r"bad.jsonl:2: invalid JSON"),
    ('{"problem": "x"}\n', r"bad.jsonl:1: no answer"),
    ('{"answer": 3}\n', r"bad.jsonl:1: no problem text"),
    ('[1, 2]\n', r"bad.jsonl:1: expected an object"),
])
def test_bad_lines_name_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        load_problems(tmp_path / "bad.jsonl")
