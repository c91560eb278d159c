"""The client of the distributed sandbox: RedisSandbox puts jobs on the Redis stream and waits
for their results; RedisSession keeps a live interpreter on the worker that opened it. The
protocol (keys, delivery, sessions): redis_queue/protocol.py; the worker: redis_queue/worker.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Iterable

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError

from sandbox.redis_queue.protocol import RETRYABLE as _RETRYABLE
from sandbox.redis_queue.protocol import Keys, connection_options, refused
from sandbox.result import ExecResult, Limits, validate_request

log = logging.getLogger("sandbox.distributed")


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
                                                        timeout=None, client_name=f"sandbox-client-{self.client_id}",
                                                        **connection_options())
        self._redis = aioredis.Redis(connection_pool=pool)
        self._waiting: dict[str, asyncio.Future] = {}  # stream entry id -> its result
        self._listener: asyncio.Task | None = None
        self._reconnects = 0  # bumped by the listener after a connection failure
        self._closing = False
        self._withdrawals: set[asyncio.Task] = set()  # departed callers' jobs being withdrawn (_cancel)

    async def __aenter__(self) -> "RedisSandbox":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._withdrawals:
            # A caller cancelled just before close: its job is withdrawn before the connections go,
            # or a worker would still run it (CI, 2026-11-29: 7 of 10 left queued under load). Bounded:
            # a withdrawal is two commands, and one that fails is given up (_cancel).
            await asyncio.wait(list(self._withdrawals), timeout=10.0)
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
            except AuthenticationError:
                return  # the call that queued its job says why (RedisRefused)
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
                except AuthenticationError as e:
                    raise refused(self.url, e) from None
                except _RETRYABLE as e:  # Redis restarting or unreachable: retry until the deadline
                    last_error = e
                    self._reconnects += 1
                    await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            why = f"redis unavailable: {last_error!r}" if last_error else "no worker returned a result"
            return ExecResult.internal(f"no result within {timeout + self.queue_timeout_s:.0f} s ({why})")
        except asyncio.CancelledError:
            if entry_id is not None and not future.done():  # the caller went away: withdraw the job
                task = asyncio.ensure_future(self._cancel(stream, entry_id))
                self._withdrawals.add(task)  # close() waits for it
                task.add_done_callback(self._withdrawn)
            raise
        finally:
            if entry_id is not None:
                self._waiting.pop(entry_id, None)

    def _withdrawn(self, task: asyncio.Task):
        self._withdrawals.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (Redis errors are suppressed in _cancel)
            log.warning("withdrawing a departed caller's job failed: %r", task.exception())

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
