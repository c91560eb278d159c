"""Distributed mode (the protocol both sides keep; redis_queue/client.py is the client, redis_queue/worker.py
the worker): clients put jobs on a Redis stream, `python -m sandbox worker` processes on
any number of hosts run them in their own LocalSandbox and post the results back.

Delivery is at least once, results exactly once:
- Jobs live in a stream read through a consumer group. A worker acknowledges a job only after
  its result is posted, and keeps claiming the jobs it is running (a heartbeat). A job whose
  worker died stops being claimed and is taken over by another worker after
  `visibility_timeout_s` (XAUTOCLAIM). A job delivered `max_deliveries` times without a result
  (one that kills its workers) goes to the dead-letter list, and its client gets an "internal"
  result saying so.
- A job may therefore run twice, but its result is marked done with SET NX: the first result
  wins and is the only one pushed to the client.
- A job is known by its stream entry id, which Redis makes: no client can choose another's, and a
  result reaches only the client whose entry it is (its reply list, read by one listener per
  client over one connection; a pooled, bounded set of connections for everything else).
- Clients never wait forever: each call has a deadline (timeout + queue_timeout_s), carried in the
  job. Workers skip a job past its deadline or cancelled by its client (a client that goes away
  deletes its queued jobs and marks them cancelled), and stop one they are running within half a
  second of either (the call is killed, its slot freed); replies expire a few seconds after the
  deadline. If Redis restarts or disappears, the call returns status "internal" saying so once
  the deadline passes.

Sessions (a live interpreter per trajectory) stay on the worker that opened them: the open goes
on the shared stream, and the worker that takes it answers with the session's id (unguessable)
and its own session stream, {p}:sessions:{worker}, where the session's cells then go. A worker
keeps {p}:alive:{worker} fresh while it serves; a client waiting for a cell of a worker whose
key is gone (it died) opens a new session, and that cell says the earlier variables are gone, as
it does when the session expired on an idle worker.

Redis asks for the job's secret ($RSTAR2_SECRET, sandbox/job_secret.py) as its password where
one is set (a password in the URL wins). A refused password is not a restart to ride out: both
sides raise RedisRefused at once.

Keys (prefix "sandbox" by default): {p}:jobs (stream), {p}:workers (group), {p}:replies:{client}
(a client's reply list), {p}:done:{entry} (exactly-once marker), {p}:cancelled:{entry},
{p}:dead (dead-letter list, newest 1,000), {p}:sessions:{worker} (stream), {p}:alive:{worker}.
"""

from __future__ import annotations

import urllib.parse

from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sandbox.job_secret import SECRET_ENV, job_secret

# failures of the connection (Redis restarting or gone), which both sides ride out; redis-py's
# AuthenticationError is one of them by class, so catch it first (RedisRefused)
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class RedisRefused(RuntimeError):
    """Redis refused this client's password (or its lack of one)."""


def connection_options() -> dict:
    """What both sides pass to redis-py besides the URL: the job's secret as the password."""
    return {"password": job_secret()}


def refused(url: str, error: AuthenticationError) -> RedisRefused:
    where = urllib.parse.urlparse(url)  # never the URL itself: it may hold a password
    return RedisRefused(f"redis at {where.hostname}:{where.port or 6379} refused this client ({error}): it needs the "
                        f"job's secret in ${SECRET_ENV}, as the server's requirepass")


class Keys:
    def __init__(self, prefix: str = "sandbox"):
        self.jobs = f"{prefix}:jobs"
        self.group = f"{prefix}:workers"
        self.dead = f"{prefix}:dead"
        self.prefix = prefix

    def replies(self, client_id: str) -> str:
        return f"{self.prefix}:replies:{client_id}"

    def done(self, entry_id: str) -> str:
        return f"{self.prefix}:done:{entry_id}"

    def cancelled(self, entry_id: str) -> str:
        return f"{self.prefix}:cancelled:{entry_id}"

    def sessions(self, worker: str) -> str:
        return f"{self.prefix}:sessions:{worker}"

    def alive(self, worker: str) -> str:
        return f"{self.prefix}:alive:{worker}"
