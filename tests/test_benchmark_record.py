"""experiments/benchmarks/common.record: a benchmark's --record replaces its own section of
BENCHMARKS.md in place, and a new subject goes before the History section (superseded figures
stay last)."""

from experiments.benchmarks import common

PAGE = """# Benchmarks

# Sandbox

## Old subject

- Device: x. Date: 2026-01-01.

| a |
|---|

# History

## Old subject: the first run

| a |
"""


def test_a_known_section_is_replaced_in_place(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE)
    common.record(str(page), "Old subject", "cmd", "cfg", "| b |\n|---|")
    text = page.read_text()
    assert text.count("## Old subject\n") == 1 and "| b |" in text
    assert text.index("| b |") < text.index("# History")
    assert text.endswith("## Old subject: the first run\n\n| a |\n")  # the history is left alone


def test_a_new_subject_goes_before_the_history(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE)
    common.record(str(page), "New subject", "cmd", "cfg", "| c |\n|---|")
    text = page.read_text()
    assert text.index("## New subject\n") < text.index("\n# History\n")
    assert text.rstrip().endswith("| a |")


def test_without_a_history_a_new_subject_is_appended(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Benchmarks\n")
    common.record(str(page), "New subject", "cmd", "cfg", "| c |\n|---|")
    assert page.read_text().rstrip().endswith("| c |\n|---|")
