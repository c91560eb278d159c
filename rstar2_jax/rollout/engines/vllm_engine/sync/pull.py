"""Weight sync to vLLM servers that share no filesystem with the trainer: the servers pull.

    trainer host                                   each server host
    export -> sync dir --- WeightFileServer ----->  WeightFetcher (beside vLLM) -> its own dir
              (HTTP, read-only, a thread)           POST /fetch  {"url", "file", "bucket", "version"}
                                                      -> vLLM reload_weights(that bucket's dir)
                                                    POST /commit {"version"}: the copy is whole

It streams like the files sync (push.push_to_servers): as soon as the trainer has written
bucket k of an export, every server's fetcher copies that bucket's file and the server reloads
it, while bucket k+1 is written. The copy of a version builds up in `v<version>.partial` and is
renamed `v<version>` once every bucket is in (/commit): a whole copy, which a later roll-back or
a restarted server reloads. `python -m rstar2_jax.rollout.serve --fetch_port P` runs a fetcher
next to the server.

The trainer's side is file_server.py (WeightFileServer), the servers' side fetcher.py
(WeightFetcher, and the trainer's calls to it); this module is what both servers share.

Both servers answer only requests that carry the job's secret ($RSTAR2_SECRET, as `Authorization:
Bearer`; sandbox/job_secret.py): otherwise anyone on the network could read the policy or, worse,
make a server reload weights of their choosing. Neither listens beyond loopback without one.
"""

from __future__ import annotations

import http.server
import json

from sandbox.job_secret import authorised

CHUNK = 8 << 20  # bytes a copy reads at a time


def reply(handler: http.server.BaseHTTPRequestHandler, status: int, obj: dict):
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def refused(handler: http.server.BaseHTTPRequestHandler, secret: str | None) -> bool:
    """Answer 401 (and True) unless the request carries `secret`."""
    if authorised(handler.headers.get("Authorization"), secret):
        return False
    reply(handler, 401, {"error": "missing or wrong secret (Authorization: Bearer $RSTAR2_SECRET)"})
    return True
