"""python -m sandbox serve | worker | bench

  serve   HTTP API (native + code-judge compatible) over an embedded pool or a Redis queue;
          set RSTAR2_SECRET (or SANDBOX_TOKEN) to require `Authorization: Bearer <it>` (needed off loopback)
  worker  take jobs from Redis and run them (start any number, on any hosts)
  bench   throughput and latency, with a fresh-interpreter baseline, and a 45,000-call burst
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from sandbox.job_secret import OpenServiceError, job_secret
from sandbox.local import ISOLATION_MODES
from sandbox.result import Limits


def _add_sandbox_args(p: argparse.ArgumentParser):
    p.add_argument("--isolation", choices=ISOLATION_MODES, default="strict")
    p.add_argument("--memory-mb", type=int, default=1024, help="address space per call on top of the zygote's")
    p.add_argument("--output-kb", type=int, default=64, help="stdout and stderr cap per call")
    p.add_argument("--uid-base", type=int, default=None,
                   help="first uid of the calls (default: a free block of this host's, see sandbox/uids.py)")


def _limits(args) -> Limits:
    return Limits(memory_bytes=args.memory_mb << 20, stdout_bytes=args.output_kb << 10,
                  stderr_bytes=args.output_kb << 10)


async def _serve(args):
    from sandbox.redis_queue.client import RedisSandbox
    from sandbox.http_service.api import SandboxHTTPServer
    from sandbox.local import LocalSandbox

    if args.redis:
        backend = RedisSandbox(args.redis, default_timeout=args.timeout)
    else:
        backend = await LocalSandbox(workers=args.workers, isolation=args.isolation, limits=_limits(args),
                                     default_timeout=args.timeout, uid_base=args.uid_base).start()
    token = os.environ.get("SANDBOX_TOKEN") or job_secret()
    server = SandboxHTTPServer(backend, default_timeout=args.timeout, workers=None if args.redis else args.workers,
                               max_connections=args.max_connections, max_body_bytes=args.max_body_mb << 20,
                               token=token)
    try:
        port = await server.start(args.host, args.port)
    except OpenServiceError as e:
        await backend.close()
        raise SystemExit(f"sandbox serve: {e}") from None
    behind = "redis " + args.redis if args.redis else f"{args.workers} local workers"
    print(f"sandbox serving on http://{args.host}:{port} ({behind})", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    await backend.close()


async def _worker(args):
    from sandbox.redis_queue.protocol import RedisRefused
    from sandbox.redis_queue.worker import RedisWorker

    worker = RedisWorker(args.redis, concurrency=args.concurrency, visibility_timeout_s=args.visibility_timeout,
                         max_deliveries=args.max_deliveries, isolation=args.isolation, limits=_limits(args),
                         uid_base=args.uid_base)
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, worker.stop)
    print(f"sandbox worker {worker.name}: {args.concurrency} slots on {args.redis}", flush=True)
    try:
        await worker.serve()
    except RedisRefused as e:
        raise SystemExit(f"sandbox worker: {e}") from None


def _run(coro):
    """uvloop where installed (it comes with orbax-checkpoint): it cuts the HTTP layer's CPU per
    request, which on a small machine competes with the calls themselves."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sandbox", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="HTTP API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8088)
    serve.add_argument("--redis", help="redis://... : queue jobs for `sandbox worker`s instead of running them here")
    serve.add_argument("--workers", type=int, default=4, help="local execution slots (without --redis)")
    serve.add_argument("--timeout", type=float, default=10.0, help="default per-call timeout, seconds")
    serve.add_argument("--max-connections", type=int, default=1024, help="connections past this get a 503")
    serve.add_argument("--max-body-mb", type=int, default=16, help="request bodies past this get a 413")
    _add_sandbox_args(serve)
    worker = sub.add_parser("worker", help="run jobs from Redis")
    worker.add_argument("--redis", required=True)
    worker.add_argument("--concurrency", type=int, default=4)
    worker.add_argument("--visibility-timeout", type=float, default=30.0,
                        help="seconds before a dead worker's job is redelivered")
    worker.add_argument("--max-deliveries", type=int, default=3,
                        help="deliveries of a job before it is dead-lettered (sandbox:dead) and answered 'internal'")
    _add_sandbox_args(worker)
    bench = sub.add_parser("bench", help="throughput / latency benchmark")
    from sandbox import bench as bench_mod
    bench_mod.add_args(bench)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        _run(_serve(args))
    elif args.command == "worker":
        _run(_worker(args))
    else:
        bench_mod.main(args)


if __name__ == "__main__":
    sys.exit(main())
