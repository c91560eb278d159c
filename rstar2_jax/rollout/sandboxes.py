"""The tool sandbox settings (`sandbox.*`) and the one way to build the sandbox client from them.

SANDBOXES maps `sandbox.backend` to how to build that client, its own settings section
(`sandbox.<backend>.*`, part_sections.py) and how to check them:
"local" forks workers on this host (sandbox.LocalSandbox); "redis" queues calls for
`python -m sandbox worker` processes on other hosts (sandbox.RedisSandbox); "http" sends them to a
`python -m sandbox serve` service (sandbox.HTTPSandbox; its token, if any, from $SANDBOX_TOKEN,
never from the config, which is written into the run directory).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import sandbox
from rstar2_jax.config_types import Section, setting
from rstar2_jax.part_sections import PartChoice, part_section
from rstar2_jax.registry import Registry
from rstar2_jax.rollout.agent_loop import TOOL_STATES


@dataclasses.dataclass(frozen=True)
class SandboxBackend:
    build: Callable[..., sandbox.SandboxClient]                 # (the whole SandboxConfig) -> an async context manager
    settings: type[Section]                                     # its own section, sandbox.<backend>.*
    check: Callable[..., Iterable[tuple[str, str]]] = lambda cfg: ()   # (field under sandbox., message) of each problem
    describe: Callable[[Section], str] = lambda own: ""         # (its own settings) -> what --plan adds after its name


SANDBOXES: Registry[SandboxBackend] = Registry("sandbox backend")


@dataclasses.dataclass(frozen=True)
class LocalSandboxSettings(Section):
    """`sandbox.local.*`: workers forked on this host."""
    workers: int = setting(2, "worker processes (calls run in parallel)", min=1)
    isolation: str = setting("strict", "process confinement (strict: namespaces, seccomp, cgroups)",
                             choices=sandbox.ISOLATION_MODES)


@dataclasses.dataclass(frozen=True)
class RedisSandboxSettings(Section):
    """`sandbox.redis.*`: the queue remote `python -m sandbox worker`s serve (its password: the job's
    secret, $RSTAR2_SECRET)."""
    url: str = setting("", "the queue, redis://HOST:6379/0")


@dataclasses.dataclass(frozen=True)
class HTTPSandboxSettings(Section):
    """`sandbox.http.*`: a `python -m sandbox serve` service (its token: $RSTAR2_SECRET, or $SANDBOX_TOKEN)."""
    url: str = setting("", "the service, http://HOST:8088")


def _remote_check(backend: str, schemes: tuple[str, ...]):
    def check(cfg):
        url = cfg.settings(backend).url
        if not url.startswith(schemes):
            yield f"{backend}.url", f"sandbox.backend={backend} needs a {schemes[0]} URL, got {url!r}"
    return check


SANDBOXES.register("local", SandboxBackend(
    lambda cfg: sandbox.LocalSandbox(workers=cfg.local.workers, isolation=cfg.local.isolation), LocalSandboxSettings,
    describe=lambda own: f", {own.workers} workers, {own.isolation}"))
SANDBOXES.register("redis", SandboxBackend(lambda cfg: sandbox.RedisSandbox(cfg.redis.url), RedisSandboxSettings,
                                           _remote_check("redis", ("redis://", "rediss://", "unix://")),
                                           describe=lambda own: f" at {own.url}"))
SANDBOXES.register("http", SandboxBackend(lambda cfg: sandbox.HTTPSandbox(cfg.http.url), HTTPSandboxSettings,
                                          _remote_check("http", ("http://", "https://")),
                                          describe=lambda own: f" at {own.url}"))


class _SandboxBase(PartChoice):
    """`sandbox.*`: the backend (sandbox.backend), how tool state lives, and each backend's own
    settings (sandbox.<backend>.*; only the chosen backend's are read)."""

    @classmethod
    def upgrade_values(cls, mapping):
        if "url" in mapping:  # one flat url before each backend had its section: the backend's it was
            url = mapping.pop("url")
            backend = mapping.get("backend", "local")
            if url and backend in ("redis", "http"):
                mapping[backend] = {**mapping.get(backend, {}), "url": url}
        return mapping


SandboxConfig = part_section(
    "SandboxConfig", SANDBOXES, path="sandbox", module=__name__, base=_SandboxBase, refuse_unchosen=False,
    moved={"workers": "local.workers", "isolation": "local.isolation", "url": ("redis.url", "http.url")},
    selector=("backend", str, setting("local", "local (workers forked on this host) | redis (remote `python -m "
                                      "sandbox worker`s behind a queue) | http (a `python -m sandbox serve`)",
                                      choices=SANDBOXES)),
    common=[("tool_state", str, setting("stateless", "stateless (each call alone, the paper) | session (a live "
                                        "interpreter per trajectory)", choices=TOOL_STATES))])


def make_sandbox(cfg) -> sandbox.SandboxClient:
    """The sandbox client `cfg.backend` names (use it as `async with make_sandbox(cfg) as sb`)."""
    return SANDBOXES[cfg.backend].build(cfg)
