"""The secret every service of a job shares, so that each answers only that job.

A run's services (Redis and the sandbox workers, the HTTP sandbox, the vLLM servers, each
server's weight fetcher, the trainer's export server) listen on addresses other users of a shared
cluster can reach. Each one asks for the secret in $RSTAR2_SECRET: HTTP services as
`Authorization: Bearer <secret>` on every request, Redis as its password (`requirepass`). The
SLURM launcher makes a new one per job, in the job's environment: never on a command line, where
`ps` or `scontrol` would show it to everyone.

A service refuses to listen beyond loopback without a secret (`check_open_service`), and on
loopback says loudly that every user of the machine can reach it. It lives in `sandbox` because
the sandbox is the one package every service already imports, and it imports nothing else.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import sys

SECRET_ENV = "RSTAR2_SECRET"


class OpenServiceError(RuntimeError):
    """A service asked to listen beyond loopback with no secret to check."""


def job_secret() -> str | None:
    """The job's secret ($RSTAR2_SECRET), or None where none is set."""
    return os.environ.get(SECRET_ENV) or None


def bearer_headers(secret: str | None) -> dict[str, str]:
    """The header that carries `secret` to an HTTP service ({} without one)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def authorised(authorization: str | None, secret: str | None) -> bool:
    """Whether an Authorization header's value carries `secret` (always, where there is none to
    check). Compared in constant time: how long a refusal takes says nothing of the secret."""
    if not secret:
        return True
    given = (authorization or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {secret}".encode())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_open_service(service: str, host: str, secret: str | None, *, warn=None):
    """Refuse to serve beyond loopback without a secret; on loopback, say that it is open.

    `warn` takes the warning's text (default: one line on stderr)."""
    if secret:
        return
    if not is_loopback(host):
        raise OpenServiceError(
            f"{service}: refusing to listen on {host!r} without a secret: anyone who can reach this host could use "
            f"it. Set ${SECRET_ENV} (the SLURM launcher makes one per job) in this service's environment and in "
            "its clients'")
    message = (f"WARNING: {service} on {host} has no secret: every user of this machine can reach it "
               f"(set ${SECRET_ENV} to require one)")
    if warn is not None:
        warn(message)
    else:
        print(message, file=sys.stderr, flush=True)
