"""Typed config sections: how a module declares, documents and checks the settings it uses.

A module that needs settings owns a `Section`: a frozen dataclass whose fields are `setting`s
(default, one line of documentation, bounds or the registry of valid names) plus `rules()` for
what no single field can say. The run's config (`rl/config.py`) is built from these sections;
the experiment files only set values on the ml-collections ConfigDict made from it, so users keep
`--config=file.py --config.a.b=v`.

`Section.parse(mapping)` turns a plain mapping (a ConfigDict's `to_dict()`, a run's config.json)
into the typed section and returns every problem at once: unknown keys (with "did you mean"),
wrong types, values out of bounds, unknown names, broken rules. Nothing heavy runs before it.

    @dataclasses.dataclass(frozen=True)
    class SandboxConfig(Section):
        workers: int = setting(2, "worker processes", min=1)
        isolation: str = setting("strict", "process confinement", choices=ISOLATION_MODES)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterable, Mapping

import ml_collections

from rstar2_jax.core.registry import Registry, did_you_mean


@dataclasses.dataclass(frozen=True)
class ConfigProblem:
    path: str       # "rl.roc.mode", "stages[1].max_turns", "" for the whole config
    message: str    # what is wrong and what to do

    def __str__(self):
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigValueError(ValueError):
    """Every problem of a config, one per line."""

    def __init__(self, problems: Iterable[ConfigProblem | str]):
        self.problems = [p if isinstance(p, ConfigProblem) else ConfigProblem("", p) for p in problems]
        super().__init__("invalid config:\n  " + "\n  ".join(map(str, self.problems)))


def setting(default, doc: str, *, min=None, max=None, choices: Registry | tuple | None = None,
            nonempty: bool = False):
    """A config field: its default, what it means (one line), and what values it may take:
    `min` / `max` inclusive bounds for numbers, `choices` a Registry (or tuple) of valid names,
    `nonempty` for strings that must be set. Numbers without bounds must say why in `rules`."""
    meta = dict(doc=doc, min=min, max=max, choices=choices, nonempty=nonempty)
    if isinstance(default, type) and issubclass(default, Section):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, list):
        raise TypeError("use a tuple for a list setting's default (defaults are shared)")
    return dataclasses.field(default=default, metadata=meta)


def _join(path: str, name: str) -> str:
    if not name:
        return path
    return f"{path}.{name}" if path else name


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _choice_problem(choices, value) -> str | None:
    if isinstance(choices, Registry):
        return choices.problem(value)
    if value in choices:
        return None
    return f"must be one of {', '.join(map(repr, choices))}; {did_you_mean(value, choices)}got {value!r}"


class Section:
    """Base of the typed config sections (subclasses are frozen dataclasses of `setting`s)."""

    # A section users write out whole (a stage in a list) must name every field; the others
    # may omit fields (an older run's config.json), which then take their defaults.
    all_fields_required: typing.ClassVar[bool] = False

    # Fields that moved to another place in this section: old name -> new dotted path under it
    # ("slots" -> "jax.slots"). A config that sets an old name is told the new one; an older run's
    # config.json is read with them in their new places (`upgraded`). A tuple of paths: the place
    # depends on other values (`upgrade_values` moves it).
    moved: typing.ClassVar[Mapping[str, str | tuple[str, ...]]] = {}

    def rules(self) -> Iterable[tuple[str, str]]:
        """(field, message) for each broken rule that involves several fields (override)."""
        return ()

    # ---- a section whose fields can grow after it was built (core/part_sections.py) ----------------
    @classmethod
    def current_class(cls) -> type[Section]:
        """This section's class with every field it has now (override: a generated section gains
        a field for each part registered after it was built)."""
        return cls

    def current(self) -> Section:
        """This section as `current_class()`, the new fields at their defaults."""
        grown = type(self).current_class()
        if grown is type(self):
            return self
        return grown(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def parse(cls, mapping: Mapping[str, Any], path: str = "") -> tuple[Section | None, list[ConfigProblem]]:
        """The typed section of `mapping` and every problem of it (the section is None when a
        field could not be read). Missing keys take their defaults (older run files)."""
        if cls.current_class() is not cls:
            return cls.current_class().parse(mapping, path)
        problems: list[ConfigProblem] = []
        if not isinstance(mapping, Mapping):
            selector = cls.choice_selector()  # a part_sections choice: it was a name before
            if isinstance(mapping, str) and selector:
                return None, [ConfigProblem(path, f"is a section now: set {_join(path, selector)}={mapping!r} "
                                            f"(and the part's own settings under {path}.{mapping}.*)")]
            return None, [ConfigProblem(path, f"must be a mapping of fields, got {type(mapping).__name__}")]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in mapping:
            if cls.moved_paths(key) and key not in fields:
                new = " or ".join(_join(path, p) for p in cls.moved_paths(key))
                problems.append(ConfigProblem(_join(path, str(key)), f"moved: set {new} instead (an older run's "
                                              "config.json is read with it there)"))
            elif key not in fields:
                problems.append(ConfigProblem(_join(path, str(key)), f"unknown field; {did_you_mean(key, fields)}"
                                              f"{cls.__name__} has: {', '.join(fields)}"))
        if cls.all_fields_required:
            missing = [name for name in fields if name not in mapping]
            if missing:
                problems.append(ConfigProblem(path, f"missing {', '.join(missing)} (every one of {', '.join(fields)} "
                                              "must be given)"))
        hints = typing.get_type_hints(cls)
        values, readable = {}, True
        for name, f in fields.items():
            if name not in mapping:
                continue
            value, ok = _read(mapping[name], hints[name], _join(path, name), problems)
            readable &= ok
            if ok:
                values[name] = value
                problems += _field_problems(f, value, _join(path, name))
        if not readable:
            return None, problems
        section = cls(**values)
        problems += [ConfigProblem(_join(path, field), message) for field, message in section.rules()]
        return section, problems

    @classmethod
    def moved_paths(cls, key: str) -> tuple[str, ...]:
        """Where field `key` of this section went (its new paths under it), or () if it never moved."""
        new = cls.moved.get(key, ())
        return new if isinstance(new, tuple) else (new,)

    @classmethod
    def choice_selector(cls) -> str | None:
        """The field that chooses a part, for a section built from a registry (core/part_sections.py)."""
        selector = getattr(cls, "selector", None)
        return selector if isinstance(selector, str) else None

    @classmethod
    def upgraded(cls, mapping: Any) -> Any:
        """`mapping` (an older run's config.json) as this version writes it: every moved field at
        its new place (where that place is not set already), in nested sections too, then
        `upgrade_values`. Anything else is left for `parse` to judge."""
        if not isinstance(mapping, Mapping):
            return mapping
        out = dict(mapping)
        for old, new in cls.moved.items():
            if old not in out or isinstance(new, tuple):
                continue
            value = out.pop(old)
            *parents, leaf = new.split(".")
            node = out
            for name in parents:
                child = node.get(name)
                node[name] = dict(child) if isinstance(child, Mapping) else {}
                node = node[name]
            node.setdefault(leaf, value)
        out = cls.upgrade_values(out)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if f.name not in out:
                continue
            if isinstance(tp, type) and issubclass(tp, Section):
                out[f.name] = tp.upgraded(out[f.name])
            elif _is_tuple_of_sections(tp) and isinstance(out[f.name], (list, tuple)):
                out[f.name] = [typing.get_args(tp)[0].upgraded(v) for v in out[f.name]]
        return out

    @classmethod
    def upgrade_values(cls, mapping: dict[str, Any]) -> dict[str, Any]:
        """Override: an older run's values that this version spells otherwise (a renamed choice, a
        setting that became a section), rewritten in `mapping` (a copy, moved fields already moved)."""
        return mapping

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]):
        """The typed section, or ConfigValueError with every problem."""
        section, problems = cls.parse(mapping)
        if problems:
            raise ConfigValueError(problems)
        return section

    # ---- writing ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = [v.to_dict() if isinstance(v, Section) else v for v in value]
                value = tuple(value) if not any(isinstance(v, dict) for v in value) else value
            out[f.name] = value
        return out

    @classmethod
    def defaults(cls) -> ml_collections.ConfigDict:
        """A ConfigDict of every field at its default: what experiment files overlay. Nullable
        fields are typed placeholders, so `--config.x=v` still parses the right type."""
        grown = cls.current_class()
        return _config_dict(grown, grown())


def _config_dict(cls, section: Section) -> ml_collections.ConfigDict:
    hints = typing.get_type_hints(cls)
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        value = getattr(section, f.name)
        if isinstance(value, Section):
            value = value.current()
            setattr(c, f.name, _config_dict(type(value), value))
        elif _is_tuple_of_sections(hints[f.name]):
            setattr(c, f.name, [v.to_dict() for v in value])
        elif value is None:
            inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            setattr(c, f.name, ml_collections.config_dict.placeholder(inner[0]))
        else:
            setattr(c, f.name, value)
    return c


def _is_tuple_of_sections(tp) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) is tuple and bool(args) and isinstance(args[0], type) and issubclass(args[0], Section)


def _read(value, tp, path: str, problems: list[ConfigProblem]) -> tuple[Any, bool]:
    """`value` as type `tp` (ints widen to floats, lists become tuples, mappings sections);
    (value, False) with a problem added when it is not of that type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None, True
        (inner,) = [a for a in args if a is not type(None)]
        return _read(value, inner, path, problems)
    if isinstance(tp, type) and issubclass(tp, Section):
        section, sub = tp.parse(value, path)
        problems += sub
        return section, section is not None
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            problems.append(ConfigProblem(path, f"must be a list, got {value!r}"))
            return None, False
        items, ok = [], True
        for i, item in enumerate(value):
            v, item_ok = _read(item, args[0], f"{path}[{i}]", problems)
            items.append(v)
            ok &= item_ok
        return tuple(items), ok
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), True
    if isinstance(value, tp) and not (tp is not bool and isinstance(value, bool)):
        return value, True
    problems.append(ConfigProblem(path, f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}"))
    return None, False


def _field_problems(f: dataclasses.Field, value, path: str) -> list[ConfigProblem]:
    meta, out = f.metadata, []
    if value is None or isinstance(value, (Section, tuple)):
        return out
    if meta.get("min") is not None and value < meta["min"]:
        out.append(ConfigProblem(path, f"must be >= {meta['min']}, got {value!r} ({meta['doc']})"))
    if meta.get("max") is not None and value > meta["max"]:
        out.append(ConfigProblem(path, f"must be <= {meta['max']}, got {value!r} ({meta['doc']})"))
    if meta.get("choices") is not None:
        problem = _choice_problem(meta["choices"], value)
        if problem:
            out.append(ConfigProblem(path, problem))
    if meta.get("nonempty") and not value:
        out.append(ConfigProblem(path, f"must be set ({meta['doc']})"))
    return out


def section_at(cls: type[Section], dotted: str) -> type[Section] | None:
    """The section type at `dotted` ("rl.advantage") under `cls`, or None where there is none."""
    for name in dotted.split(".") if dotted else ():
        tp = typing.get_type_hints(cls).get(name)
        if not (isinstance(tp, type) and issubclass(tp, Section)):
            return None
        cls = tp
    return cls


def moved_to(cls: type[Section], dotted: str) -> tuple[str, ...]:
    """Where setting `dotted` ("rollout.slots") of config section `cls` lives now, if it moved
    (Section.moved along its path): its new path(s); () for a setting that never moved."""
    prefix, _, leaf = dotted.rpartition(".")
    parent = section_at(cls, prefix)
    return tuple(_join(prefix, p) for p in parent.moved_paths(leaf)) if parent is not None else ()


def changed_fields(section: Section) -> list[str]:
    """The fields of `section` that differ from its type's defaults (a registry's per-entry
    settings: only the selected entries' may be changed)."""
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def leaves(cls, prefix: str = "") -> Iterable[tuple[str, dataclasses.Field, Any]]:
    """(dotted path, field, type) of every leaf setting of a section class, nested sections
    walked (a tuple of sections yields its element type's leaves under `path[0]`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], _join(prefix, f.name)
        if isinstance(tp, type) and issubclass(tp, Section):
            yield from leaves(tp.current_class(), path)
        elif _is_tuple_of_sections(tp):
            yield from leaves(typing.get_args(tp)[0], f"{path}[0]")
        else:
            yield path, f, tp
