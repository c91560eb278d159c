"""Distributed mode: clients put jobs on a Redis stream, `python -m sandbox worker` processes on
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

Keys (prefix "sandbox" by default): {p}:jobs (stream), {p}:workers (group), {p}:replies:{client}
(a client's reply list), {p}:done:{entry} (exactly-once marker), {p}:cancelled:{entry},
{p}:dead (dead-letter list, newest 1,000), {p}:sessions:{worker} (stream), {p}:alive:{worker}.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

from sandbox.jobs import Job, MalformedJob, dead_letter_record, parse_job, reply_of
from sandbox.local import LocalSandbox
from sandbox.result import ExecResult, Limits, validate_request

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
_RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


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


class _WorkerGone(Exception):
    """The worker holding a session stopped serving (its alive key expired)."""


class RedisSandbox:
    """Client: same `run` / `run_many` as LocalSandbox, executed by remote workers."""

    def __init__(self, url: str, *, prefix: str = "sandbox", default_timeout: float = 5.0,
                 queue_timeout_s: float = 300.0, max_timeout_s: float = Limits().max_timeout_s,
                 max_connections: int = 16):
        self.url = url
        self.keys = Keys(prefix)
        self.default_timeout = default_timeout
        self.queue_timeout_s = queue_timeout_s
        self.max_timeout_s = max_timeout_s
        self.client_id = uuid.uuid4().hex
        self.reply_key = self.keys.replies(self.client_id)
        pool = aioredis.BlockingConnectionPool.from_url(url, decode_responses=True, socket_connect_timeout=2,
                                                        socket_keepalive=True, max_connections=max_connections,
                                                        timeout=None, client_name=f"sandbox-client-{self.client_id}")
        self._redis = aioredis.Redis(connection_pool=pool)
        self._waiting: dict[str, asyncio.Future] = {}  # stream entry id -> its result
        self._listener: asyncio.Task | None = None
        self._reconnects = 0  # bumped by the listener after a connection failure
        self._closing = False

    async def __aenter__(self) -> "RedisSandbox":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._listener is not None:
            # The listener ends by itself within a second (its BLPOP's timeout). Cancelling it
            # mid-BLPOP can leave it waiting inside redis-py for good, so that is the last resort.
            self._closing = True
            done, _ = await asyncio.wait([self._listener], timeout=3.0)
            if not done:
                self._listener.cancel()
                await asyncio.wait([self._listener], timeout=1.0)
            self._listener = None
        await self._redis.aclose()

    async def _listen(self):
        """One BLPOP loop for all of this client's calls: each reply goes to its entry's future
        (a reply for an entry this client is not waiting for, late or forged, is dropped)."""
        while not self._closing:
            try:
                reply = await self._redis.blpop([self.reply_key], timeout=1)
            except _RETRYABLE:
                self._reconnects += 1
                await asyncio.sleep(0.2)
                continue
            if reply is None:
                continue
            try:
                msg = json.loads(reply[1])
                future = self._waiting.get(msg["entry"])
                if future is not None and not future.done():
                    ExecResult.from_dict(msg["result"])  # malformed: dropped here, not in the caller
                    future.set_result(msg)
            except (ValueError, KeyError, TypeError):
                log.warning("dropped a malformed reply on %s", self.reply_key)

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        timeout = validate_request(code, stdin, timeout, default_timeout=self.default_timeout,
                                   max_timeout=self.max_timeout_s)
        msg = await self._call(self.keys.jobs, {"code": code, "stdin": stdin}, timeout)
        return msg if isinstance(msg, ExecResult) else ExecResult.from_dict(msg["result"])

    async def session(self) -> "RedisSession":
        """A live interpreter on one worker for one trajectory (as LocalSandbox.session)."""
        session = RedisSession(self)
        await session._open()
        return session

    async def _call(self, stream: str, payload: dict, timeout: float, *, alive_key: str | None = None):
        """Queue one job on `stream` and wait for its reply: the reply message, or an "internal"
        ExecResult when none came by the deadline. alive_key: the worker that must serve it (a
        session's); raises _WorkerGone once that key has expired."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._listen())
        deadline = time.monotonic() + timeout + self.queue_timeout_s
        job = json.dumps({**payload, "timeout": timeout, "reply_to": self.reply_key,
                          "deadline": time.time() + timeout + self.queue_timeout_s})
        future = asyncio.get_running_loop().create_future()
        last_error = None
        entry_id = None          # the job's stream entry (its id), once queued
        seen_reconnects = self._reconnects
        try:
            while time.monotonic() < deadline:
                try:
                    if entry_id is not None and self._reconnects != seen_reconnects:
                        seen_reconnects = self._reconnects
                        if await self._lost(stream, entry_id):  # Redis restarted without it: queue it again
                            self._waiting.pop(entry_id, None)
                            entry_id = None
                    if alive_key is not None and not await self._redis.exists(alive_key):
                        raise _WorkerGone(alive_key)
                    if entry_id is None:
                        entry_id = await self._redis.xadd(stream, {"job": job})
                        self._waiting[entry_id] = future
                    wait = max(0.1, min(1.0, deadline - time.monotonic()))
                    return await asyncio.wait_for(asyncio.shield(future), wait)
                except asyncio.TimeoutError:
                    continue
                except _RETRYABLE as e:  # Redis restarting or unreachable: retry until the deadline
                    last_error = e
                    self._reconnects += 1
                    await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            why = f"redis unavailable: {last_error!r}" if last_error else "no worker returned a result"
            return ExecResult.internal(f"no result within {timeout + self.queue_timeout_s:.0f} s ({why})")
        except asyncio.CancelledError:
            if entry_id is not None and not future.done():  # the caller went away: withdraw the job
                task = asyncio.ensure_future(self._cancel(stream, entry_id))
                task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
            raise
        finally:
            if entry_id is not None:
                self._waiting.pop(entry_id, None)

    async def _cancel(self, stream: str, entry_id: str):
        """Delete a departed caller's job from the queue, and mark it cancelled for a worker that
        took it already (it skips it, or it finishes unheard)."""
        with contextlib.suppress(RedisError, *_RETRYABLE):
            await self._redis.set(self.keys.cancelled(entry_id), "1", ex=int(self.max_timeout_s + 60))
            await self._redis.xdel(stream, entry_id)

    async def _lost(self, stream: str, entry_id: str) -> bool:
        """After a connection failure: True when Redis no longer has the job (it restarted without
        persistence) and it was not finished. A worker deletes an entry only after marking it done,
        so an entry that is gone without its done marker was lost, not finished."""
        if await self._redis.xrange(stream, entry_id, entry_id):
            return False
        return not await self._redis.exists(self.keys.done(entry_id))

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.run(r["code"], r.get("stdin", ""), r.get("timeout"))
                                           for r in requests)))

    async def queue_depth(self) -> int:
        """Jobs in the stream not yet acknowledged (waiting or running)."""
        try:
            return int(await self._redis.xlen(self.keys.jobs))
        except RedisError:
            return -1


class RedisSession:
    """A session on one `python -m sandbox worker`: `run` / `close` as sandbox.Session.

    If its worker lost the interpreter (it died, restarted, or closed the session after it sat
    idle), the next call opens a new one, on any worker, and says so in its stderr."""

    def __init__(self, sb: RedisSandbox):
        self._sb = sb
        self.id: str | None = None
        self.stream = self.alive_key = None
        self.closed = False
        self.restarts = 0
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> "RedisSession":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _open(self):
        msg = await self._sb._call(self._sb.keys.jobs, {"op": "session_open"}, self._sb.default_timeout)
        info = None if isinstance(msg, ExecResult) else msg.get("session")
        if not isinstance(info, dict):
            why = msg.stderr if isinstance(msg, ExecResult) else ExecResult.from_dict(msg["result"]).stderr
            raise RuntimeError(f"no sandbox worker could open a session: {why}")
        self.id, self.stream, self.alive_key = info["id"], info["stream"], info["alive"]

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        timeout = validate_request(code, stdin, timeout, default_timeout=self._sb.default_timeout,
                                   max_timeout=self._sb.max_timeout_s)
        if self.closed:
            raise RuntimeError("the session is closed")
        async with self._lock:
            note = ""
            for _ in range(2):
                try:
                    msg = await self._sb._call(self.stream, {"op": "session_run", "session": self.id, "code": code,
                                                             "stdin": stdin}, timeout, alive_key=self.alive_key)
                except _WorkerGone:
                    msg = {"session_lost": True}
                if not isinstance(msg, ExecResult) and msg.get("session_lost"):
                    await self._open()
                    self.restarts += 1
                    note = "[the sandbox worker lost this session: its earlier variables are gone]\n"
                    continue
                result = msg if isinstance(msg, ExecResult) else ExecResult.from_dict(msg["result"])
                return dataclasses.replace(result, stderr=note + result.stderr) if note else result
            return ExecResult.internal("the sandbox lost this session twice in one call")

    async def close(self):
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:  # best effort, briefly: an unclosed session ends after its idle timeout
            with contextlib.suppress(RedisError, *_RETRYABLE, _WorkerGone, asyncio.TimeoutError):
                await asyncio.wait_for(self._sb._call(self.stream, {"op": "session_close", "session": self.id},
                                                      5.0, alive_key=self.alive_key), 10.0)


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
                                        socket_connect_timeout=2)
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
