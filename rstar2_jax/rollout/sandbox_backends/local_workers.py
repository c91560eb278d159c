"""`sandbox.backend=local`: workers forked on this host (sandbox.LocalSandbox)."""

from __future__ import annotations

import dataclasses

import sandbox
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.rollout.sandbox_backends.base import SANDBOXES, SandboxBackend


@dataclasses.dataclass(frozen=True)
class LocalSandboxSettings(Section):
    """`sandbox.local.*`: workers forked on this host."""
    workers: int = setting(2, "worker processes (calls run in parallel)", min=1)
    isolation: str = setting("strict", "process confinement (strict: namespaces, seccomp, cgroups)",
                             choices=sandbox.ISOLATION_MODES)


SANDBOXES.register("local", SandboxBackend(
    lambda cfg: sandbox.LocalSandbox(workers=cfg.local.workers, isolation=cfg.local.isolation), LocalSandboxSettings,
    describe=lambda own: f", {own.workers} workers, {own.isolation}"))
