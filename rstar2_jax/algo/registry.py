"""Name -> function tables, so an ablation is a config string."""

from __future__ import annotations

from typing import Callable


def register(table: dict[str, Callable], name: str):
    """Decorator: `@register(TABLE, "name")` adds the function to TABLE under `name`."""
    def deco(fn):
        if name in table:
            raise ValueError(f"{name!r} is registered twice")
        table[name] = fn
        return fn
    return deco


def lookup(table: dict[str, Callable], name: str, what: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; registered: {sorted(table)}")
    return table[name]
