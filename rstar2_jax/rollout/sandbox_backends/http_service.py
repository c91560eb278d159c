"""`sandbox.backend=http`: calls sent to a `python -m sandbox serve` service (sandbox.HTTPSandbox;
its token, if any, from $RSTAR2_SECRET or $SANDBOX_TOKEN, never from the config, which is written
into the run directory)."""

from __future__ import annotations

import dataclasses

import sandbox
from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.rollout.sandbox_backends.base import SANDBOXES, SandboxBackend, url_check


@dataclasses.dataclass(frozen=True)
class HTTPSandboxSettings(Section):
    """`sandbox.http.*`: a `python -m sandbox serve` service (its token: $RSTAR2_SECRET, or $SANDBOX_TOKEN)."""
    url: str = setting("", "the service, http://HOST:8088")


SANDBOXES.register("http", SandboxBackend(lambda cfg: sandbox.HTTPSandbox(cfg.http.url), HTTPSandboxSettings,
                                          url_check("http", ("http://", "https://")),
                                          describe=lambda own: f" at {own.url}"))
