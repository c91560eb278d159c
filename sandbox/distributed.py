"""Distributed mode: clients put jobs on a Redis stream, `python -m sandbox worker` processes on
any number of hosts run them in their own LocalSandbox and post the results back.

Delivery is at least once, results exactly once:
- Jobs live in a stream read through a consumer group. A worker acknowledges a job only after
  its result is stored, and keeps claiming the jobs it is running (a heartbeat). A job whose
  worker died stops being claimed and is taken over by another worker after
  `visibility_timeout_s` (XAUTOCLAIM).
- A job may therefore run twice, but its result is stored with SET NX: the first result wins and
  is the only one pushed to the client's reply list. Results expire after `result_ttl_s`.
- Clients never wait forever: each call has a deadline (timeout + queue_timeout_s). If Redis
  restarts or disappears, the call returns status "internal" saying so once the deadline passes.

Keys (prefix "sandbox" by default): {p}:jobs (stream), {p}:workers (group),
{p}:result:{job_id} (reply list), {p}:done:{job_id} (exactly-once marker).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Iterable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError, TimeoutError as RedisTimeoutError

from sandbox.local import LocalSandbox
from sandbox.result import ExecResult, Limits, validate_request

log = logging.getLogger("sandbox.distributed")

# Store the result once (SET NX) and only then hand it to the waiting client.
_FINISH = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  return 1
end
return 0
"""
_RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class Keys:
    def __init__(self, prefix: str = "sandbox"):
        self.jobs = f"{prefix}:jobs"
        self.group = f"{prefix}:workers"
        self.prefix = prefix

    def result(self, job_id: str) -> str:
        return f"{self.prefix}:result:{job_id}"

    def done(self, job_id: str) -> str:
        return f"{self.prefix}:done:{job_id}"


class RedisSandbox:
    """Client: same `run` / `run_many` as LocalSandbox, executed by remote workers."""

    def __init__(self, url: str, *, prefix: str = "sandbox", default_timeout: float = 5.0,
                 queue_timeout_s: float = 300.0, max_timeout_s: float = Limits().max_timeout_s):
        self.url = url
        self.keys = Keys(prefix)
        self.default_timeout = default_timeout
        self.queue_timeout_s = queue_timeout_s
        self.max_timeout_s = max_timeout_s
        self._redis = aioredis.from_url(url, decode_responses=True, socket_connect_timeout=2,
                                        socket_keepalive=True)

    async def __aenter__(self) -> "RedisSandbox":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        await self._redis.aclose()

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        timeout = validate_request(code, stdin, timeout, default_timeout=self.default_timeout,
                                   max_timeout=self.max_timeout_s)
        job_id = uuid.uuid4().hex
        deadline = time.monotonic() + timeout + self.queue_timeout_s
        job = json.dumps({"id": job_id, "code": code, "stdin": stdin, "timeout": timeout})
        last_error = None
        entry_id = None          # the job's stream entry, once queued
        reconnected = False      # the connection failed since it was queued: is the job still known?
        while time.monotonic() < deadline:
            try:
                if entry_id is not None and reconnected and await self._lost(entry_id, job_id):
                    entry_id = None  # Redis restarted without it: queue it again (one result still: _FINISH)
                reconnected = False
                if entry_id is None:
                    entry_id = await self._redis.xadd(self.keys.jobs, {"job": job})
                wait = max(0.1, min(1.0, deadline - time.monotonic()))
                reply = await self._redis.blpop([self.keys.result(job_id)], timeout=wait)
                if reply is not None:
                    return ExecResult.from_dict(json.loads(reply[1]))
            except _RETRYABLE as e:  # Redis restarting or unreachable: retry until the deadline
                last_error = e
                reconnected = True
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        why = f"redis unavailable: {last_error!r}" if last_error else "no worker returned a result"
        return ExecResult.internal(f"no result within {timeout + self.queue_timeout_s:.0f} s ({why})")

    async def _lost(self, entry_id: str, job_id: str) -> bool:
        """After a connection failure: True when Redis no longer has the job (it restarted without
        persistence) and no result is waiting. A worker deletes an entry only after posting its
        result, so an entry that is gone with no result posted was lost, not finished."""
        if await self._redis.xrange(self.keys.jobs, entry_id, entry_id):
            return False
        return not await self._redis.exists(self.keys.result(job_id), self.keys.done(job_id))

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.run(r["code"], r.get("stdin", ""), r.get("timeout"))
                                           for r in requests)))

    async def queue_depth(self) -> int:
        """Jobs in the stream not yet acknowledged (waiting or running)."""
        try:
            return int(await self._redis.xlen(self.keys.jobs))
        except RedisError:
            return -1


class RedisWorker:
    """Takes jobs from Redis and runs them in a LocalSandbox of `concurrency` slots."""

    def __init__(self, url: str, *, concurrency: int = 4, prefix: str = "sandbox",
                 visibility_timeout_s: float = 30.0, result_ttl_s: int = 600,
                 name: str | None = None, **sandbox_kwargs):
        self.url = url
        self.keys = Keys(prefix)
        self.concurrency = concurrency
        self.visibility_timeout_s = visibility_timeout_s
        self.result_ttl_s = result_ttl_s
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.sandbox = LocalSandbox(workers=concurrency, **sandbox_kwargs)
        self._redis = aioredis.from_url(url, decode_responses=True, socket_connect_timeout=2)
        self._running: dict[str, asyncio.Task] = {}  # stream entry id -> task
        self._stop = asyncio.Event()
        self.completed = 0

    async def _ensure_group(self):
        try:
            await self._redis.xgroup_create(self.keys.jobs, self.keys.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def stop(self):
        self._stop.set()

    async def serve(self):
        async with self.sandbox:
            heartbeat = asyncio.create_task(self._heartbeat())
            try:
                while not self._stop.is_set():
                    try:
                        await self._ensure_group()
                        await self._take_jobs()
                    except _RETRYABLE as e:
                        log.warning("redis unavailable (%r); retrying", e)
                        await asyncio.sleep(0.5)
                    except ResponseError as e:
                        if "NOGROUP" in str(e):  # Redis restarted empty: recreate the group
                            continue
                        raise
            finally:
                heartbeat.cancel()
                if self._running:
                    await asyncio.gather(*self._running.values(), return_exceptions=True)
                await self._redis.aclose()

    async def _take_jobs(self):
        free = self.concurrency - len(self._running)
        if free <= 0:
            await asyncio.wait(list(self._running.values()), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            return
        # Jobs whose worker stopped claiming them (it died) come first.
        idle_ms = int(self.visibility_timeout_s * 1000)
        _, claimed, _ = await self._redis.xautoclaim(self.keys.jobs, self.keys.group, self.name,
                                                     min_idle_time=idle_ms, start_id="0-0", count=free)
        entries = [e for e in claimed if e and e[1]]
        if not entries:
            reply = await self._redis.xreadgroup(self.keys.group, self.name, {self.keys.jobs: ">"},
                                                 count=free, block=500)
            entries = [e for _, stream_entries in reply or [] for e in stream_entries]
        for entry_id, fields in entries:
            if entry_id not in self._running:
                self._running[entry_id] = asyncio.create_task(self._execute(entry_id, fields))

    async def _execute(self, entry_id: str, fields: dict[str, str]):
        job: dict[str, Any] = {}
        try:
            try:
                job = json.loads(fields["job"])
                timeout = validate_request(job["code"], job.get("stdin", ""), job.get("timeout"),
                                           default_timeout=5.0, max_timeout=self.sandbox.limits.max_timeout_s)
                result = await self.sandbox.run(job["code"], job.get("stdin", ""), timeout)
            except (KeyError, ValueError, TypeError, AttributeError) as e:
                result = ExecResult.internal(f"malformed job: {e}")
            if isinstance(job, dict) and "id" in job:
                await self._finish(job["id"], result)
            await self._redis.xack(self.keys.jobs, self.keys.group, entry_id)
            await self._redis.xdel(self.keys.jobs, entry_id)
            self.completed += 1
        except _RETRYABLE as e:
            # Not acknowledged: after the visibility timeout another worker (or this one) reruns it.
            log.warning("could not post result of %s (%r); it will be redelivered", entry_id, e)
        finally:
            self._running.pop(entry_id, None)

    async def _finish(self, job_id: str, result: ExecResult):
        await self._redis.eval(_FINISH, 2, self.keys.done(job_id), self.keys.result(job_id),
                               json.dumps(result.to_dict()), str(self.result_ttl_s))

    async def _heartbeat(self):
        """Re-claim running jobs so their idle time stays below the visibility timeout."""
        while True:
            await asyncio.sleep(self.visibility_timeout_s / 3)
            ids = list(self._running)
            if not ids:
                continue
            try:
                await self._redis.xclaim(self.keys.jobs, self.keys.group, self.name, min_idle_time=0,
                                         message_ids=ids, justid=True)
            except RedisError as e:
                log.warning("heartbeat failed: %r", e)
