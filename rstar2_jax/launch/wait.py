"""`python -m rstar2_jax.launch.wait [--timeout S] [--alive PID]... ADDRESS...`: wait until each answers.

redis://HOST:PORT[/DB] is up when a PING gets PONG; http(s)://... when a GET returns 2xx. Both
show the job's secret ($RSTAR2_SECRET) where one is set, as the trainer will. Exits 1 naming what
did not answer in time (the batch script stops there, before the trainer starts), or at once
when a process named by --alive (the steps that serve them) has ended: a server that failed to
start is not waited for until the timeout.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import redis

from sandbox.job_secret import bearer_headers, job_secret


def answers(address: str) -> bool:
    secret = job_secret()
    try:
        if urllib.parse.urlparse(address).scheme == "redis":
            client = redis.Redis.from_url(address, password=secret, socket_timeout=2, socket_connect_timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        with urllib.request.urlopen(urllib.request.Request(address, headers=bearer_headers(secret)), timeout=5) as r:
            return 200 <= r.status < 300
    except (OSError, urllib.error.URLError, redis.RedisError):
        return False


def running(pid: int) -> bool:
    """Whether process `pid` is running (a zombie, ended but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m rstar2_jax.launch.wait")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--alive", type=int, action="append", default=[],
                   help="stop waiting (exit 1) once this process has ended; repeat")
    p.add_argument("addresses", nargs="+")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    waiting = list(args.addresses)
    while waiting and time.monotonic() < deadline:
        waiting = [a for a in waiting if not answers(a)]
        ended = [pid for pid in args.alive if not running(pid)]
        if waiting and ended:
            print(f"process(es) {', '.join(map(str, ended))} ended before {', '.join(waiting)} answered: "
                  "see their step logs", file=sys.stderr)
            sys.exit(1)
        if waiting:
            time.sleep(1.0)
    if waiting:
        print(f"no answer within {args.timeout:g} s from: {', '.join(waiting)}", file=sys.stderr)
        sys.exit(1)
    print(f"up: {', '.join(args.addresses)}", flush=True)


if __name__ == "__main__":
    main()
