"""`sandbox.backend=redis`: calls queued for `python -m sandbox worker` processes on other hosts
(sandbox.RedisSandbox; the queue's password is the job's secret, $RSTAR2_SECRET)."""

from __future__ import annotations

import dataclasses

import sandbox
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.rollout.sandbox_backends.base import SANDBOXES, SandboxBackend, url_check


@dataclasses.dataclass(frozen=True)
class RedisSandboxSettings(Section):
    """`sandbox.redis.*`: the queue remote `python -m sandbox worker`s serve (its password: the job's
    secret, $RSTAR2_SECRET)."""
    url: str = setting("", "the queue, redis://HOST:6379/0")


SANDBOXES.register("redis", SandboxBackend(lambda cfg: sandbox.RedisSandbox(cfg.redis.url), RedisSandboxSettings,
                                           url_check("redis", ("redis://", "rediss://", "unix://")),
                                           describe=lambda own: f" at {own.url}"))
