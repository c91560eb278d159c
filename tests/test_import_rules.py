"""docs/DESIGN.md's import rules hold on the module graph: the block tagged `import-rules` is
read from the document itself, so the document and the code cannot drift apart.

    PACKAGE may import: A, B        its modules' load-time imports outside PACKAGE stay within A, B
    MODULE never loads: X, Y        importing MODULE loads none of X, Y (transitively, packages'
                                    __init__s included)
    MODULE never imports: X, Y      not even lazily, from inside a function (transitively)
    PACKAGE never depends on: X     no module of PACKAGE imports X, even lazily and transitively,
                                    leaving out the packages' __init__s it passes (they re-export:
                                    `engines/__init__` loads every kind, which is not a dependency of
                                    one kind on another)
"""

import ast
import os
import re

import pytest

from tests.import_graph import ROOT, direct_imports, loads, module_files, within

RULE = re.compile(r"^(\S+)\s+(may import|never loads|never imports|never depends on):\s*(.*)$")


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
                         and not any(within(d, t) or within(t, d) for t in targets)})  # a target's parent packages load with it
    elif kind == "never depends on":
        reached = depends_on(subject, LAZY_GRAPH)
        broken = sorted(m for m in reached for t in targets if within(m, t))
    else:
        graph = GRAPH if kind == "never loads" else LAZY_GRAPH
        reached = loads(subject, graph)
        broken = sorted(m for m in reached for t in targets if within(m, t))
    assert not broken, f"docs/DESIGN.md: `{subject} {kind}: {', '.join(targets) or 'nothing'}` is broken by {broken}"


def depends_on(subject: str, graph: dict[str, set[str]]) -> set[str]:
    """What the modules within `subject` import, transitively, not counting packages' __init__s
    they pass on the way (a package that re-exports its parts is not a dependency on all of them)."""
    seen = set()
    todo = [m for m in graph if within(m, subject)]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [d for d in graph.get(m, ()) if not (d in PACKAGE_INITS and not within(d, subject))]
    return seen


PACKAGE_INITS = {m for m, path in MODULES.items() if path.endswith("__init__.py")}


def test_depends_on_leaves_out_the_packages_it_passes():
    graph = {"p": {"p.a", "p.b"}, "p.a": {"p"}, "p.b": {"q.x"}, "q.x": set(), "r.y": {"p.a"}}
    global PACKAGE_INITS
    saved, PACKAGE_INITS = PACKAGE_INITS, {"p"}
    try:
        assert depends_on("r", graph) == {"r.y", "p.a"}
        assert depends_on("p.b", graph) == {"p.b", "q.x"}
    finally:
        PACKAGE_INITS = saved


ENGINE_CLASSES = ("JaxEngine", "VLLMEngine", "Scheduler")
MARKER = "engine by name:"  # on the line or the one above: why this code must name an engine (rare)


def engine_named_sites(module: str, source: str, names: set[str]) -> list[tuple[int, str]]:
    """Where code outside rollout/engines/ names an engine: a string that is an engine's name or one
    of its settings' keys ("jax", "vllm.urls": a comparison, a dict key, `.get("jax")`), an
    attribute named after it (`cfg.rollout.jax.page_size`), or `isinstance` of a concrete engine.
    Docstrings are prose, not code."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            head, _, key = node.value.partition(".")
            if head in names and (not key or key.isidentifier()):
                found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Attribute) and node.attr in names and not _is_module_path(node):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2 and any(c in ast.unparse(node.args[1]) for c in ENGINE_CLASSES):
            found.append((node.lineno, ast.unparse(node)))
    lines = source.splitlines()
    return [(n, what) for n, what in found if not any(MARKER in lines[k] for k in (n - 1, n - 2) if k >= 0)]


def _is_module_path(node: ast.Attribute) -> bool:
    """`jax.numpy`-like chains start at a module name, not at a config: rstar2_jax.x, jax.y."""
    root = node
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in ("rstar2_jax", "jax")


def test_no_module_outside_the_engines_names_an_engine():
    """Code asks an engine's kind (rollout/engines/engine_kind.EngineKind) what it needs to know;
    naming a registered engine outside rollout/engines/ is a branch a new engine misses."""
    from rstar2_jax.rollout.engines import ENGINES
    found = []
    for module, path in MODULES.items():
        if module.startswith("rstar2_jax.rollout.engines") or not module.startswith("rstar2_jax"):
            continue
        found += [f"{os.path.relpath(path, ROOT)}:{n}: {what}"
                  for n, what in engine_named_sites(module, open(path).read(), set(ENGINES))]
    assert not found, "\n".join(found)


def test_the_engine_name_check_sees_every_form():
    names = {"jax", "vllm"}
    source = ('def f(cfg, values, engine):\n'
              '    """Reads jax: prose, not code."""\n'
              '    a = cfg.engine == "vllm"\n'
              '    b = {"vllm.urls": "--url"}\n'
              '    c = values.get("jax", {})\n'
              '    d = cfg.rollout.jax.page_size\n'
              '    e = isinstance(engine, VLLMEngine)\n'
              '    g = jax.numpy.zeros(1)\n'
              '    # engine by name: allowed, with its reason\n'
              '    h = "jax"\n')
    assert sorted(n for n, _ in engine_named_sites("m", source, names)) == [3, 4, 5, 6, 7]

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


def test_an_rl_run_derives_its_seeds_in_one_module():
    """Issue 71: the rollouts', top-ups', pre-filter's, evaluations', RoC's and the data order's
    seeds come from rl/seeds.py, each a named stream; no other module of rl/ derives one."""
    derive = re.compile(r"\b(stable_seed|default_rng|SeedSequence)\(")
    found = [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}"
             for module, path in MODULES.items() if within(module, "rstar2_jax.rl") and module != "rstar2_jax.rl.seeds"
             for i, line in enumerate(open(path), 1) if derive.search(line.split("#", 1)[0])]
    assert not found, "\n".join(found)
