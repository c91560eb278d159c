"""The tool sandbox settings (`sandbox.*`) and the one way to build the sandbox client from them.

SANDBOXES maps `sandbox.backend` to how to build that client and check the settings it reads:
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
from rstar2_jax.registry import Registry
from rstar2_jax.rollout.agent_loop import TOOL_STATES


@dataclasses.dataclass(frozen=True)
class SandboxBackend:
    build: Callable[["SandboxConfig"], sandbox.SandboxClient]      # an async context manager
    check: Callable[["SandboxConfig"], Iterable[tuple[str, str]]]  # (field, message) of each problem


SANDBOXES: Registry[SandboxBackend] = Registry("sandbox backend")


@dataclasses.dataclass(frozen=True)
class SandboxConfig(Section):
    backend: str = setting("local", "local (workers forked on this host) | redis (remote `python -m sandbox "
                           "worker`s behind the queue at url) | http (a `python -m sandbox serve` at url)",
                           choices=SANDBOXES)
    workers: int = setting(2, "local: worker processes (calls run in parallel)", min=1)
    isolation: str = setting("strict", "local: process confinement (strict: namespaces, seccomp, cgroups)",
                             choices=sandbox.ISOLATION_MODES)
    tool_state: str = setting("stateless", "stateless (each call alone, the paper) | session (a live "
                              "interpreter per trajectory)", choices=TOOL_STATES)
    url: str = setting("", "redis: the queue, redis://HOST:6379/0; http: the service, http://HOST:8088")

    def rules(self):
        if self.backend in SANDBOXES:
            yield from SANDBOXES[self.backend].check(self)


def make_sandbox(cfg: SandboxConfig) -> sandbox.SandboxClient:
    """The sandbox client `cfg.backend` names (use it as `async with make_sandbox(cfg) as sb`)."""
    return SANDBOXES[cfg.backend].build(cfg)


def _check_local(cfg: SandboxConfig):
    if cfg.url:
        yield "url", "is only read with sandbox.backend=redis or http"


def _remote_check(schemes: tuple[str, ...]):
    def check(cfg: SandboxConfig):
        if not cfg.url.startswith(schemes):
            yield "url", f"sandbox.backend={cfg.backend} needs a {schemes[0]} URL, got {cfg.url!r}"
    return check


SANDBOXES.register("local", SandboxBackend(
    lambda cfg: sandbox.LocalSandbox(workers=cfg.workers, isolation=cfg.isolation), _check_local))
SANDBOXES.register("redis", SandboxBackend(lambda cfg: sandbox.RedisSandbox(cfg.url),
                                           _remote_check(("redis://", "rediss://", "unix://"))))
SANDBOXES.register("http", SandboxBackend(lambda cfg: sandbox.HTTPSandbox(cfg.url),
                                          _remote_check(("http://", "https://"))))
