"""Module paths of earlier versions that have moved: importing one fails with the new path named.

A finder at the end of sys.meta_path, so it is asked only about modules no file answers for.
Each package installs its own table (sandbox's below; rstar2_jax/__init__.py has rstar2_jax's).
"""

from __future__ import annotations

import importlib.abc
import sys


class MovedModules(importlib.abc.MetaPathFinder):
    def __init__(self, package: str, moved: dict[str, str]):
        self.package = package
        self.moved = {f"{package}.{old}": f"{package}.{new}" for old, new in moved.items()}

    def find_spec(self, fullname, path=None, target=None):
        new = self.moved.get(fullname)
        if new is not None:
            raise ModuleNotFoundError(f"{fullname} has moved: import {new} instead", name=fullname)
        return None


def install(package: str, moved: dict[str, str]) -> None:
    """Once per package (a second install of the same package is a no-op)."""
    if not any(isinstance(f, MovedModules) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(MovedModules(package, moved))


# issue 82: the zygote, the Redis queue and the HTTP service became packages
SANDBOX_MOVED = {
    "cgroups": "zygote.cgroups",
    "confine": "zygote.confine",
    "http_api": "http_service.api",
    "http_client": "http_service.client",
    "http_guards": "http_service.guards",
    "http_metrics": "http_service.metrics",
    "redis_client": "redis_queue.client",
    "redis_protocol": "redis_queue.protocol",
    "redis_worker": "redis_queue.worker",
    "syscall_policy": "zygote.syscall_policy",
    "wire": "zygote.wire",
    "zygote_child": "zygote.child",
    "zygote_closer": "zygote.closer",
    "zygote_forker": "zygote.forker",
    "zygote_sessions": "zygote.sessions",
    "zygote_splice": "zygote.splice",
    "zygote_start": "zygote.start",
    "zygote_state": "zygote.state",
    "zygote_supervise": "zygote.supervise",
    "zygote_usercode": "zygote.usercode",
    "zygote_worker": "zygote.worker",
}
install("sandbox", SANDBOX_MOVED)
