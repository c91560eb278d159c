"""`python -m sandbox worker`: takes jobs from the Redis stream (at least once), runs them in its
own LocalSandbox and posts each result exactly once. The protocol: redis_queue/protocol.py; the client:
redis_queue/client.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from sandbox.jobs import Job, MalformedJob, dead_letter_record, parse_job, reply_of
from sandbox.local import LocalSandbox
from sandbox.redis_queue.protocol import RETRYABLE as _RETRYABLE
from sandbox.redis_queue.protocol import Keys, connection_options, refused
from sandbox.result import ExecResult, validate_request

log = logging.getLogger("sandbox.distributed")

# Mark the result done once (SET NX) and only then hand it to the waiting client's reply list.
_FINISH = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  return 1
end
return 0
"""
DEAD_LETTERS_KEPT = 1000


class RedisWorker:
    """Takes jobs from Redis and runs them in a LocalSandbox of `concurrency` slots."""

    def __init__(self, url: str, *, concurrency: int = 4, prefix: str = "sandbox",
                 visibility_timeout_s: float = 30.0, result_ttl_s: int = 600, max_deliveries: int = 3,
                 name: str | None = None, **sandbox_kwargs):
        """result_ttl_s: the longest a reply waits for its client (it expires 5 s after the client's
        deadline, sooner than this when that is earlier); max_deliveries: deliveries of a job
        before it is dead-lettered."""
        self.url = url
        self.keys = Keys(prefix)
        self.concurrency = concurrency
        self.visibility_timeout_s = visibility_timeout_s
        self.result_ttl_s = result_ttl_s
        self.max_deliveries = max_deliveries
        self.dead_lettered = 0
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.sandbox = LocalSandbox(workers=concurrency, **sandbox_kwargs)
        # surrogateescape: an entry's bytes that are not UTF-8 reach parse_job (which refuses them)
        # instead of failing the read of the whole batch
        self._redis = aioredis.from_url(url, decode_responses=True, encoding_errors="surrogateescape",
                                        socket_connect_timeout=2, **connection_options())
        self._running: dict[str, asyncio.Task] = {}  # stream entry id -> task
        self._stop = asyncio.Event()
        self.completed = 0
        self.session_stream = self.keys.sessions(self.name)  # the cells of the sessions opened here
        self.alive_key = self.keys.alive(self.name)
        self._sessions: dict[str, Any] = {}  # session id -> the LocalSandbox Session

    async def _ensure_group(self):
        for stream in (self.keys.jobs, self.session_stream):
            try:
                await self._redis.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
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
                    except AuthenticationError as e:  # not a restart: no password will come by waiting
                        raise refused(self.url, e) from None
                    except _RETRYABLE as e:
                        log.warning("redis unavailable (%r); retrying", e)
                        await asyncio.sleep(0.5)
                    except ResponseError as e:
                        if "NOGROUP" in str(e):  # Redis restarted empty: recreate the group
                            continue
                        log.exception("redis refused a command; going on")
                        await asyncio.sleep(0.5)
                    except Exception:  # noqa: BLE001 - no job content may end the worker's loop
                        log.exception("unexpected error in the worker's loop; going on")
                        await asyncio.sleep(0.5)
            finally:
                heartbeat.cancel()
                if self._running:
                    await asyncio.gather(*self._running.values(), return_exceptions=True)
                with contextlib.suppress(RedisError, *_RETRYABLE):  # its sessions end with it: say so at once
                    await self._redis.delete(self.alive_key, self.session_stream)
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
        entries = []
        for entry_id, fields in (e for e in claimed if e and e[1]):
            if (n := await self._deliveries(entry_id)) > self.max_deliveries:
                await self._dead_letter(self.keys.jobs, entry_id, fields, f"delivered {n - 1} times without a "
                                        "result (the job may kill the workers that run it)")
            else:
                entries.append((self.keys.jobs, entry_id, fields))
        if not entries:  # new jobs, and cells of the sessions opened here (never claimed by others)
            reply = await self._redis.xreadgroup(self.keys.group, self.name,
                                                 {self.keys.jobs: ">", self.session_stream: ">"},
                                                 count=free, block=500)
            entries = [(stream, *e) for stream, stream_entries in reply or [] for e in stream_entries]
        for stream, entry_id, fields in entries:
            if entry_id in self._running:
                continue
            try:
                job = parse_job(fields, self.keys.prefix)
            except MalformedJob as e:  # refused on first sight: never run, never redelivered
                await self._dead_letter(stream, entry_id, fields, str(e))
                continue
            self._running[entry_id] = asyncio.create_task(self._execute(stream, entry_id, job))

    async def _execute(self, stream: str, entry_id: str, job: Job):
        extra: dict[str, Any] = {}
        try:
            try:
                if await self._redis.exists(self.keys.cancelled(entry_id)) or time.time() > job.deadline:
                    result = None  # its client went away or gave up: nobody to answer
                else:
                    result, extra = await self._run_unless_cancelled(entry_id, job)
            except ValueError as e:  # a request validate_request refuses (a timeout out of range, ...)
                result = ExecResult.internal(f"malformed job: {e}")
            except _RETRYABLE:
                raise
            except Exception as e:  # noqa: BLE001 - answered and acknowledged, never redelivered forever
                log.exception("job %s failed in the worker", entry_id)
                result = ExecResult.internal(f"the worker failed on this job: {type(e).__name__}: {e}")
            if result is not None:
                await self._finish(entry_id, job.reply_to, job.deadline, result, extra)
            await self._redis.xack(stream, self.keys.group, entry_id)
            await self._redis.xdel(stream, entry_id)
            self.completed += 1
        except _RETRYABLE as e:
            # Not acknowledged: after the visibility timeout another worker (or this one) reruns it.
            log.warning("could not post result of %s (%r); it will be redelivered", entry_id, e)
        finally:
            self._running.pop(entry_id, None)

    async def _run_unless_cancelled(self, entry_id: str, job: dict, poll_s: float = 0.5):
        """_run_job, stopped (its call killed, its slot freed) once the client withdraws the job
        (it went away: RedisSandbox._cancel marks it) or its deadline passes; (None, {}) then."""
        task = asyncio.ensure_future(self._run_job(job))
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=poll_s)
                if done:
                    return task.result()
                try:
                    withdrawn = await self._redis.exists(self.keys.cancelled(entry_id))
                except _RETRYABLE:
                    withdrawn = False  # Redis unreachable: keep running; the answer is posted when it is back
                if withdrawn or time.time() > job.deadline:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return None, {}
        finally:
            if not task.done():  # this worker is stopping: the call goes with it
                task.cancel()

    async def _run_job(self, job: Job) -> tuple[ExecResult, dict]:
        """(the result, extra reply fields) of one job: a stateless call or a session operation."""
        op = job.op
        if op == "session_open":
            from sandbox.local import SessionLimitError
            try:
                session = await self.sandbox.session()
            except SessionLimitError as e:
                return ExecResult.internal(str(e)), {}
            session_id = uuid.uuid4().hex + uuid.uuid4().hex  # unguessable: the session's only key
            self._sessions[session_id] = session
            await self._mark_alive()  # before its client first looks (the heartbeat keeps it fresh)
            info = {"id": session_id, "stream": self.session_stream, "alive": self.alive_key}
            return ExecResult(status="ok"), {"session": info}
        if op == "session_close":
            session = self._sessions.pop(job.session, None)
            if session is not None:
                await session.close()
            return ExecResult(status="ok"), {}
        timeout = validate_request(job.code, job.stdin, job.timeout, default_timeout=5.0,
                                   max_timeout=self.sandbox.limits.max_timeout_s)
        if op == "run":
            return await self.sandbox.run(job.code, job.stdin, timeout), {}
        session = self._sessions.get(job.session)  # session_run
        if session is None or session.closed:  # closed after being idle, or never here
            self._sessions.pop(job.session, None)
            return ExecResult.internal("no such session on this worker"), {"session_lost": True}
        return await session.run(job.code, job.stdin, timeout), {}

    async def _mark_alive(self):
        """This worker serves: its sessions' clients wait for their cells while this key lasts."""
        await self._redis.set(self.alive_key, "1", ex=max(1, int(self.visibility_timeout_s)))

    async def _finish(self, entry_id: str, reply_to: str, deadline: float, result: ExecResult,
                      extra: dict | None = None):
        """Post the result once (the done marker), to the reply list the job names."""
        ttl = int(min(self.result_ttl_s, max(5.0, deadline - time.time() + 5.0)))
        await self._redis.eval(_FINISH, 2, self.keys.done(entry_id), reply_to,
                               json.dumps({"entry": entry_id, "result": result.to_dict(), **(extra or {})}), str(ttl))

    async def _deliveries(self, entry_id: str) -> int:
        pending = await self._redis.xpending_range(self.keys.jobs, self.keys.group, min=entry_id, max=entry_id,
                                                   count=1)
        return int(pending[0]["times_delivered"]) if pending else 0

    async def _dead_letter(self, stream: str, entry_id: str, fields: dict, reason: str):
        """An entry refused on first sight (malformed: jobs.parse_job says why) or delivered
        max_deliveries times without a result (it kills its workers): kept in the dead-letter list
        with the reason, its client (if it names one) answered with an error, acknowledged. Never
        fails on the entry's content."""
        self.dead_lettered += 1
        log.warning("dead-lettering %s: %s", entry_id, reason)
        await self._redis.lpush(self.keys.dead, dead_letter_record(entry_id, fields, reason, self.name))
        await self._redis.ltrim(self.keys.dead, 0, DEAD_LETTERS_KEPT - 1)
        reply = reply_of(fields, self.keys.prefix)
        if reply is not None:
            await self._finish(entry_id, *reply, ExecResult.internal(f"dead-lettered: {reason}"))
        await self._redis.xack(stream, self.keys.group, entry_id)
        await self._redis.xdel(stream, entry_id)

    async def _heartbeat(self):
        """Re-claim running jobs so their idle time stays below the visibility timeout, and keep
        this worker's alive key (its sessions' clients read it) from expiring."""
        while True:
            with contextlib.suppress(RedisError, *_RETRYABLE):
                await self._mark_alive()
            await asyncio.sleep(self.visibility_timeout_s / 3)
            ids = list(self._running)
            if not ids:
                continue
            try:
                await self._redis.xclaim(self.keys.jobs, self.keys.group, self.name, min_idle_time=0,
                                         message_ids=ids, justid=True)
            except RedisError as e:
                log.warning("heartbeat failed: %r", e)
