"""The module graph of the repository's packages, from import statements (no code runs): who
imports whom at import time. Imports inside functions are lazy and do not count; importing
`a.b.c` runs `a/__init__` and `a/b/__init__` too, so those are edges of the closure."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("rstar2_jax", "sandbox")


def module_files() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].split(os.sep)
                    if rel[-1] == "__init__":
                        rel = rel[:-1]
                    out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _top_level_imports(tree: ast.Module):
    """Import nodes executed when the module loads: module body, and inside top-level if / try /
    with blocks, except `if TYPE_CHECKING:`."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        elif isinstance(node, ast.With):
            stack += node.body


def direct_imports(modules: dict[str, str], lazy: bool = False) -> dict[str, set[str]]:
    """module -> our modules its load imports by name (a `from pkg import name` of a submodule
    names the submodule); with `lazy`, also those imported inside its functions."""
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        deps = set()
        nodes = ([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if lazy
                 else _top_level_imports(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = name.split(".")
                    parts = parts if is_package else parts[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:  # `import a.b.c` where c is a name: the module a.b
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def loads(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every one of our modules that importing `module` loads (packages' __init__s included)."""
    seen, todo = set(), [module, *ancestors(module)]
    while todo:
        m = todo.pop()
        if m in seen or m not in graph:
            continue
        seen.add(m)
        for dep in graph[m]:
            todo += [dep, *ancestors(dep)]
    return seen


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")
