"""The tool sandbox settings (`sandbox.*`) and the one way to build the sandbox client from them.

SANDBOXES (sandbox_backends/base.py) maps `sandbox.backend` to how to build that client, its own
settings section (`sandbox.<backend>.*`, core/part_sections.py) and how to check them. Each backend is
a module of sandbox_backends/, imported here once (a new backend: its module and one line below):
"local" forks workers on this host (local_workers.py); "redis" queues calls for
`python -m sandbox worker` processes on other hosts (redis_queue.py); "http" sends them to a
`python -m sandbox serve` service (http_service.py).
"""

from __future__ import annotations

import sandbox
from rstar2_jax.core.config_types import setting
from rstar2_jax.core.part_sections import PartChoice, part_section
from rstar2_jax.rollout.agent_loop import TOOL_STATES
# Each backend registers itself; this order is the choices' order in --helpconfig and the config.
from rstar2_jax.rollout.sandbox_backends import local_workers  # noqa: F401
from rstar2_jax.rollout.sandbox_backends import redis_queue  # noqa: F401
from rstar2_jax.rollout.sandbox_backends import http_service  # noqa: F401
from rstar2_jax.rollout.sandbox_backends.base import SANDBOXES


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
