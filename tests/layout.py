"""docs/DESIGN.md's layout block read as a tree, and `make layout`: the package tree with each
package's one-line purpose, as that block gives it (one place for both: tests/test_layout.py
checks the block against the files).

    python -m tests.layout            packages only
    python -m tests.layout --modules  every module too
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout_lines(text: str) -> list[tuple[int, str, str]]:
    """(depth, name, purpose) for each line of the "## Layout" block, in order."""
    section = text[text.index("## Layout\n"):]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "docs/DESIGN.md's Layout section has no ``` block"
    out = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0, f"odd indent in the layout: {line!r}"
        name, _, purpose = line.strip().partition(" ")
        out.append((indent // 2, name, purpose.strip()))
    return out


def layout_entries(text: str) -> set[str]:
    """The paths the layout block names: 'pkg/' for a package, 'pkg/mod.py' for a module."""
    entries, parents = set(), []
    for depth, name, _ in layout_lines(text):
        assert depth <= len(parents), f"a level skipped in the layout (one line an entry): {name!r}"
        parents = parents[:depth]
        path = "".join(parents) + name
        entries.add(path)
        if name.endswith("/"):
            parents.append(name)
    return entries


def main(argv: list[str]) -> None:
    modules = "--modules" in argv
    for depth, name, purpose in layout_lines(open(os.path.join(ROOT, "docs", "DESIGN.md")).read()):
        if modules or name.endswith("/"):
            print(f"{'  ' * depth + name:<36} {purpose}")


if __name__ == "__main__":
    main(sys.argv[1:])
