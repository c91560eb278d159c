"""docs/DESIGN.md's layout is the tree: its "## Layout" block lists every package and module of
rstar2_jax/ and sandbox/ at its place (two spaces of indent a level), and nothing that is not
there. The layout lives on that page alone (README points to it)."""

import os

import pytest

from tests.layout import layout_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("rstar2_jax", "sandbox")  # the packages whose every module the layout names


def tree_entries() -> set[str]:
    out = set()
    for top in CHECKED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, ROOT).replace(os.sep, "/") + "/"
            out.add(rel)
            out.update(rel + f for f in filenames if f.endswith(".py") and not f.startswith("__"))
    return out


def test_the_layout_block_reads_as_a_tree():
    entries = layout_entries("## Layout\n```\na/\n  b.py   x\n  c/\n    d.py  y\ne/\n```\n")
    assert entries == {"a/", "a/b.py", "a/c/", "a/c/d.py", "e/"}
    with pytest.raises(AssertionError, match="a level skipped"):
        layout_entries("## Layout\n```\na/\n    b.py\n```\n")


def test_design_md_lists_every_package_and_module_and_nothing_else():
    listed = layout_entries(open(os.path.join(ROOT, "docs", "DESIGN.md")).read())
    listed = {e for e in listed if e.split("/")[0] in CHECKED}
    tree = tree_entries()
    assert not tree - listed, f"in the tree, missing from docs/DESIGN.md's layout: {sorted(tree - listed)}"
    assert not listed - tree, f"in docs/DESIGN.md's layout, not in the tree: {sorted(listed - tree)}"


def test_readme_has_no_layout_of_its_own():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "## Layout" not in readme
    assert len(readme.splitlines()) <= 300, "README.md grew past 300 lines: move detail to docs/"


def test_no_engine_module_is_over_500_lines():
    """Issue 71: the engines area in modules of one job each (vllm_engine/engine.py had grown to 766)."""
    engines = os.path.join(ROOT, "rstar2_jax", "rollout", "engines")
    long = {os.path.relpath(path, engines): n for dirpath, _, files in os.walk(engines) for f in files
            if f.endswith(".py") for path in [os.path.join(dirpath, f)]
            for n in [sum(1 for _ in open(path))] if n > 500}
    assert not long, f"over 500 lines: {long}"


def test_make_layout_prints_every_package_with_its_purpose():
    """`make layout` (tests/layout.py): the package tree, each package with its line of the layout."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tests.layout"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    printed = {line.split()[0] for line in out.splitlines() if line.strip()}
    packages = {e.rstrip("/").rsplit("/", 1)[-1] + "/" for e in tree_entries() if e.endswith("/")}
    assert packages <= printed, f"not printed: {sorted(packages - printed)}"
    assert all(len(line.split(None, 1)) == 2 for line in out.splitlines() if line.strip()), "a package without its purpose"
    assert all(word.endswith("/") for word in printed), "a module among the packages"


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of each function or method of `source` over `limit` lines, docstring included."""
    import ast
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_no_library_function_is_over_80_lines():
    """Issue 82: a function longer than a screen does several jobs (push_weights had grown to 145)."""
    found = [f"{os.path.relpath(os.path.join(dirpath, f), ROOT)}: {name} ({n} lines)"
             for top in CHECKED for dirpath, _, files in os.walk(os.path.join(ROOT, top)) for f in files
             if f.endswith(".py") for name, n in long_functions(open(os.path.join(dirpath, f)).read(), 80)]
    assert not found, "\n".join(found)


def test_the_long_function_check_counts_a_function_s_whole_body():
    body = "def f():\n" + "    x = 1\n" * 80
    assert long_functions(body, 80) == [("f", 81)] and long_functions(body, 81) == []
