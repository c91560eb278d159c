"""The one name -> implementation table of the codebase, so that an ablation is a config string.

Every swappable part is a `Registry`: advantages, policy losses, RoC selections and RoC modes,
tasks, prompt formats, engines, scheduler policies, sandbox backends, ... A registry refuses a name
registered twice, and an unknown name is an error that lists the registered ones, with the
closest first ("did you mean").

    LOSSES = Registry("policy loss")

    @LOSSES.register("clip_higher")
    def clip_higher_loss(...): ...

    LOSSES["clip_higher"]            # the function; LOSSES["clip_hihger"] -> UnknownNameError
    LOSSES.problem("clip_hihger")    # the error message, or None for a registered name

A registry is a mapping (`name in R`, `sorted(R)`, `R.items()`); assigning `R[name] = entry`
registers (tests add entries that way and remove them with `del R[name]`).
"""

from __future__ import annotations

import difflib
from typing import Callable, Iterator, MutableMapping, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name no entry of a registry has; the message lists the ones it has."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0])


def did_you_mean(name: str, known) -> str:
    """'did you mean 'x'? ' when one of `known` is close to `name`, else ''."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


class Registry(MutableMapping[str, T]):
    def __init__(self, what: str):
        self.what = what            # what an entry is, for messages: "policy loss", "engine", ...
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T | None = None) -> Callable[[T], T] | T:
        """`@R.register("name")` on a function or class, or `R.register("name", entry)`."""
        if entry is not None:
            self[name] = entry
            return entry

        def deco(obj: T) -> T:
            self[name] = obj
            return obj
        return deco

    def problem(self, name) -> str | None:
        """Why `name` is not a valid choice (did you mean first, then every registered name), or None."""
        if isinstance(name, str) and name in self._entries:
            return None
        return f"unknown {self.what} {name!r}; {did_you_mean(name, self._entries)}registered: {', '.join(sorted(self._entries))}"

    # ---- mapping ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise UnknownNameError(self.problem(name))
        return self._entries[name]

    def __setitem__(self, name: str, entry: T):
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry

    def __delitem__(self, name: str):
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self):
        return f"Registry({self.what!r}: {', '.join(self._entries)})"
