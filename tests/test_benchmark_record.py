"""experiments/benchmarks/common.record: a benchmark's --record replaces its own section of
BENCHMARKS.md in place, a new subject goes last in its subsystem (before the History section,
superseded figures staying last), and the page's contents follow its headings."""

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


def test_a_known_section_is_replaced_in_place_and_the_old_one_moves_to_history(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE)
    common.record(str(page), "Old subject", "cmd", "cfg", "| b |\n|---|")
    text = page.read_text()
    current, history = text.split("\n# History\n")
    assert current.count("## Old subject\n") == 1 and "| b |" in current and "| a |" not in current
    assert 'Earlier figures: History, "Old subject (2026-01-01)"' in current  # one line saying where
    # the replaced section opens the History (newest first), dated; the older history stays below it
    assert history.index("## Old subject (2026-01-01)\n\n- Device: x.") < history.index("## Old subject: the first run")
    assert text.endswith("## Old subject: the first run\n\n| a |\n")


def test_a_page_without_history_gets_one_for_the_replaced_section(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Benchmarks\n\n## S\n\nDate: 2026-02-03\n\n| a |\n")
    common.record(str(page), "S", "cmd", "cfg", "| b |\n|---|")
    current, history = page.read_text().split("\n# History\n")
    assert "| b |" in current and "| a |" not in current and "## S (2026-02-03)\n" in history and "| a |" in history


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


GROUPED = """# Benchmarks

Contents:
- stale

# Sandbox

## S1

- Date: 2026-01-01.

# Learner

## L1

- Date: 2026-01-02.

# History

## S1 (2025-12-01)
"""


def test_a_new_subject_goes_last_in_its_subsystem_and_the_contents_follow(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(GROUPED)
    common.record(str(page), "S2", "cmd", "cfg", "| s |\n|---|", group="Sandbox")
    common.record(str(page), "M1", "cmd", "cfg", "| m |\n|---|", group="Memory plan")  # a subsystem the page lacks
    text = page.read_text()
    order = [text.index(h) for h in ("# Sandbox\n", "## S1\n", "## S2\n", "# Learner\n", "## L1\n",
                                      "# Memory plan\n", "## M1\n", "# History\n", "## S1 (2025-12-01)")]
    assert order == sorted(order), order
    assert "\n\n## S2\n" in text and "| s |\n|---|\n\n# Learner\n" in text  # a blank line either side
    contents = text.split("Contents:\n")[1].split("\n# ")[0]
    assert contents.strip().splitlines() == [
        "- **Sandbox**: S1; S2", "- **Learner**: L1", "- **Memory plan**: M1",
        "- **History**: superseded figures and the sections' longer notes, newest first"]


def test_the_page_s_contents_list_its_sections():
    """BENCHMARKS.md's Contents are what `common.with_contents` makes of its headings (a section
    added or moved by hand is listed where it is)."""
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md")
    text = open(path).read()
    assert common.with_contents(text) == text


def test_the_page_reads_current_first():
    """Issue 71: BENCHMARKS.md holds at most 1,000 lines before its History, and every section
    there names the date of its figures near its top (superseded ones are in History)."""
    import os
    import re
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md")).read()
    assert "\n# History\n" in text
    current = text.split("\n# History\n")[0]
    assert len(current.splitlines()) <= 1000, f"{len(current.splitlines())} lines before History"
    undated = [part.split("\n")[0] for part in re.split(r"\n(?=## )", current)[1:]
               if not re.search(r"\d{4}-\d{2}-\d{2}", "\n".join(part.split("\n")[:10]))]
    assert not undated, undated
