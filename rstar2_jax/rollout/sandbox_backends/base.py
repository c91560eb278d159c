"""What a sandbox backend is (`SandboxBackend`), the registry `sandbox.backend` chooses from
(SANDBOXES), and the URL check the remote backends share.

A backend is its module: a settings section (`sandbox.<backend>.*`) and one
`SANDBOXES.register(name, SandboxBackend(...))`; `rollout/sandboxes.py` imports each module
once and builds `sandbox.*` from what registered.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import sandbox
from rstar2_jax.core.config_types import Section
from rstar2_jax.core.registry import Registry


@dataclasses.dataclass(frozen=True)
class SandboxBackend:
    build: Callable[..., sandbox.SandboxClient]                 # (the whole SandboxConfig) -> an async context manager
    settings: type[Section]                                     # its own section, sandbox.<backend>.*
    check: Callable[..., Iterable[tuple[str, str]]] = lambda cfg: ()   # (field under sandbox., message) of each problem
    describe: Callable[[Section], str] = lambda own: ""         # (its own settings) -> what --plan adds after its name


SANDBOXES: Registry[SandboxBackend] = Registry("sandbox backend")


def url_check(backend: str, schemes: tuple[str, ...]):
    """A check that `sandbox.<backend>.url` starts with one of `schemes` (a remote backend's)."""
    def check(cfg):
        url = cfg.settings(backend).url
        if not url.startswith(schemes):
            yield f"{backend}.url", f"sandbox.backend={backend} needs a {schemes[0]} URL, got {url!r}"
    return check
