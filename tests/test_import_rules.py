"""docs/DESIGN.md's import rules hold on the module graph: the block tagged `import-rules` is
read from the document itself, so the document and the code cannot drift apart.

    PACKAGE may import: A, B        its modules' load-time imports outside PACKAGE stay within A, B
    MODULE never loads: X, Y        importing MODULE loads none of X, Y (transitively, packages'
                                    __init__s included)
    MODULE never imports: X, Y      not even lazily, from inside a function (transitively)
"""

import os
import re

import pytest

from tests.import_graph import ROOT, direct_imports, loads, module_files, within

RULE = re.compile(r"^(\S+)\s+(may import|never loads|never imports):\s*(.*)$")


def design_rules() -> list[tuple[str, str, list[str]]]:
    text = open(os.path.join(ROOT, "docs", "DESIGN.md")).read()
    block = re.search(r"```import-rules\n(.*?)```", text, re.S)
    assert block, "docs/DESIGN.md has no ```import-rules block"
    rules = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = RULE.match(line)
            assert match, f"unreadable import rule: {line!r}"
            subject, kind, targets = match.groups()
            rules.append((subject, kind, [] if targets.strip() == "nothing" else
                          [t.strip() for t in targets.split(",") if t.strip()]))
    return rules


MODULES = module_files()
GRAPH = direct_imports(MODULES)
LAZY_GRAPH = direct_imports(MODULES, lazy=True)
RULES = design_rules()


def test_the_rules_name_real_modules():
    for subject, _, targets in RULES:
        for name in (subject, *targets):
            assert any(within(m, name) for m in MODULES), f"import rule names {name!r}, which is not a module"


def test_every_package_of_the_library_has_a_may_import_rule():
    top = {".".join(m.split(".")[:2]) for m in MODULES if m.startswith("rstar2_jax.") and
           os.path.basename(MODULES[m]) == "__init__.py"}
    covered = {s for s, kind, _ in RULES if kind == "may import"}
    assert top <= covered, f"packages without a rule in docs/DESIGN.md: {sorted(top - covered)}"


@pytest.mark.parametrize("subject, kind, targets", RULES, ids=[f"{s} {k}" for s, k, _ in RULES])
def test_import_rule(subject, kind, targets):
    if kind == "may import":
        broken = sorted({f"{m} imports {d}" for m, deps in GRAPH.items() if within(m, subject)
                         for d in deps if not within(d, subject) and d != "rstar2_jax"
                         and not any(within(d, t) for t in targets)})
    else:
        graph = GRAPH if kind == "never loads" else LAZY_GRAPH
        reached = loads(subject, graph)
        broken = sorted(m for m in reached for t in targets if within(m, t))
    assert not broken, f"docs/DESIGN.md: `{subject} {kind}: {', '.join(targets) or 'nothing'}` is broken by {broken}"


def test_no_module_outside_the_engines_compares_an_engine_s_name():
    """Code asks an engine's kind (rollout/engines/factory.EngineKind) what it needs to know; a
    comparison with a registered name outside rollout/engines/ is a branch a new engine misses."""
    from rstar2_jax.rollout.engines import ENGINES
    names = "|".join(map(re.escape, ENGINES))
    compare = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = []
    for module, path in MODULES.items():
        if module.startswith("rstar2_jax.rollout.engines") or not module.startswith("rstar2_jax"):
            continue
        for i, line in enumerate(open(path), 1):
            if compare.search(line.split("#", 1)[0]):
                found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), leaving out a module's
    imports of its own packages (their __init__ re-exports it: not a dependency of design)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if within(v, w):  # its own package
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_even_lazy_or_for_annotations_only():
    """Every import counts (at load, inside functions, under TYPE_CHECKING): a cycle is two modules
    that cannot be read, tested or replaced one without the other (issue 71)."""
    cycles = module_cycles(LAZY_GRAPH)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a": {"a.x"}, "a.w": {"a"}}
    assert module_cycles(graph) == [["a.x", "a.y", "a.z"]]
