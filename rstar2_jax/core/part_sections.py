"""The one shape of a swappable part's settings: a section generated from its registry.

Every registry of parts (policy losses, off-policy corrections, advantage estimators, RoC modes,
engines, sandbox backends, tasks) registers specs that carry their own `settings` Section, and
the config section that chooses among them is generated here from what is registered:

    rollout.engine = "jax"            # the selector (its choices: the registry)
    rollout.max_len = 640             # settings every part reads (the section's common fields)
    rollout.jax.slots = 32            # one section per registered part, its own settings
    rollout.vllm.urls = (...)

Algorithm parts (losses, corrections, advantage estimators) refuse a change to a part that is not
chosen: the setting would have no effect, so it is a config error that names the selector. Infra
parts (engines, sandbox backends, tasks) keep them unread, with a warning at start: an experiment
file may configure the embedded engine and a command line switch to vLLM (`refuse_unchosen`
False). A spec may also give `check(section)`: the
(field, message) problems of the chosen part's settings read with the common ones, fields named
relative to the section ("jax.page_size"). Adding a part is then its module (spec + settings)
and one import where its registry is filled; the config, `--helpconfig` and the checks follow.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterable

from rstar2_jax.core.config_types import Section, changed_fields, setting
from rstar2_jax.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class NoSettings(Section):
    """The settings of a part that has none of its own (its section stays empty)."""


class PartChoice(Section):
    """Base of a generated section: which parts are chosen, their settings, and the rule that no
    other part's settings are changed. Subclasses add rules with `yield from super().rules()`."""

    registry: typing.ClassVar[Registry]
    selector: typing.ClassVar[str]
    path: typing.ClassVar[str]          # where the section sits in the run's config, for messages
    refuse_unchosen: typing.ClassVar[bool] = True   # a not-chosen part's changed setting: error, else warning

    @classmethod
    def current_class(cls) -> type[Section]:
        """This section with a field for every part registered after it was built too (a part
        module imported by an experiment file, a test's): its settings are then set, checked,
        written and resumed like a built-in part's (rl.loss.<late part>.*)."""
        late = [name for name in cls.registry if not any(f.name == name for f in dataclasses.fields(cls))]
        if not late:
            return cls
        key = tuple(late)
        grown = _GROWN.get((cls, key))
        if grown is None:
            grown = dataclasses.make_dataclass(
                cls.__name__, _part_fields(cls.registry, late, taken={f.name for f in dataclasses.fields(cls)},
                                           base=cls, class_name=cls.__name__),
                bases=(cls,), frozen=True, namespace={"__module__": cls.__module__, "__doc__": cls.__doc__})
            _GROWN[(cls, key)] = grown
        return grown

    def chosen(self) -> tuple[str, ...]:
        """The chosen parts' names (one, the selector's value; a multi-choice section overrides)."""
        return (getattr(self, self.selector),)

    def settings(self, name: str | None = None) -> Section:
        """The settings section of part `name` (default: the chosen one; a part registered after
        this section was made has no field here: its settings' defaults)."""
        name = name or getattr(self, self.selector)
        own = getattr(self, name, None)
        return own if isinstance(own, Section) else self.registry[name].settings()

    def spec(self) -> Any:
        """The chosen part's registered spec."""
        return self.registry[getattr(self, self.selector)]

    def not_chosen(self, other: str) -> str:
        """What to do about a changed setting of part `other`, which is not chosen."""
        at = f"{self.path}.{self.selector}"
        return (f"belongs to {self.registry.what} {other!r}, but {at} is {getattr(self, self.selector)!r} "
                f"(set {at}={other}, or leave {self.path}.{other}.* at their defaults)")

    def unchosen_changes(self) -> list[tuple[str, str]]:
        """(part, field) of each setting changed in a part that is not chosen."""
        chosen, out = self.chosen(), []
        for other in self.registry:
            own = getattr(self, other, None)
            if other not in chosen and isinstance(own, Section):
                out += [(other, name) for name in changed_fields(own)]
        return out

    def warnings(self) -> list[str]:
        """The settings a run keeps but does not read (refuse_unchosen False)."""
        if self.refuse_unchosen:
            return []
        at = f"{self.path}.{self.selector}"
        return [f"{self.path}.{part}.{name} is set but unread: {at} is {getattr(self, self.selector)!r}"
                for part, name in self.unchosen_changes()]

    def rules(self) -> Iterable[tuple[str, str]]:
        if self.refuse_unchosen:
            for other, name in self.unchosen_changes():
                yield f"{other}.{name}", self.not_chosen(other)
        for name in self.chosen():
            check = getattr(self.registry.get(name), "check", None) if isinstance(name, str) else None
            if check is not None:
                yield from check(self)


def unread_settings(section: Section) -> list[str]:
    """The warnings of every part choice in `section` and the sections under it: the settings a
    run keeps but does not read (a not-chosen engine's, sandbox backend's or task's)."""
    out = section.warnings() if isinstance(section, PartChoice) else []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, Section):
            out += unread_settings(value)
    return out


_GROWN: dict[tuple[type, tuple[str, ...]], type] = {}   # (section class, late parts) -> its grown class


def _part_fields(registry: Registry, names: Iterable[str], *, taken: set[str], base: type, class_name: str):
    """One field per part of `names`, holding its settings; a part may not shadow a field or method."""
    out = []
    for name in names:
        if name in taken or hasattr(base, name):
            raise ValueError(f"{registry.what} {name!r} is named like a field or method of {class_name}: rename it")
        spec = registry[name]
        out.append((name, spec.settings, setting(spec.settings, f"settings of the {name!r} {registry.what}")))
    return out


def part_section(class_name: str, registry: Registry, *, path: str, selector: tuple[str, type, Any],
                 common: Iterable[tuple[str, type, Any]] = (), base: type[PartChoice] = PartChoice,
                 module: str, moved: dict[str, Any] | None = None, refuse_unchosen: bool = True) -> type[Section]:
    """The section `path` choosing among `registry`'s parts: the selector field (name, type,
    setting), the `common` fields, then one field per registered part holding its settings.
    Build it after every part is registered (the end of the module that imports them). `moved`:
    fields this section had before they moved (Section.moved)."""
    fields = [selector, *common]
    fields += _part_fields(registry, list(registry), taken={f[0] for f in fields}, base=base, class_name=class_name)
    namespace = {"__module__": module, "__doc__": base.__doc__, "registry": registry, "selector": selector[0],
                 "path": path, "moved": dict(moved or {}), "refuse_unchosen": refuse_unchosen}
    return dataclasses.make_dataclass(class_name, fields, bases=(base,), frozen=True, namespace=namespace)
