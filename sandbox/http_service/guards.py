"""What the HTTP service does before a request reaches a handler: connections past the limit
refused with a 503 (RefuseConnection), read and write deadlines on every connection
(ReadDeadline, wrapping aiohttp's protocol), request bodies parsed with their limits
(parse_body: every malformed body a 400 naming why), and calls of different requests taking turns
for the workers (FairTurns). Used by sandbox/http_service/api.py."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from typing import Any

BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 35\r\n"
         b"Connection: close\r\n\r\n{\"error\": \"too many connections\"}\n")


class RefuseConnection(asyncio.Protocol):
    """A connection past the limit: one 503, then closed (never reaches aiohttp). It reads what
    the client sent first: closing with unread data would reset the connection and lose the 503."""

    def connection_made(self, transport):
        self.transport = transport
        transport.write(BUSY_RESPONSE)
        self.timer = asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data):
        self.timer.cancel()
        self.transport.close()


class ReadDeadline(asyncio.Protocol):
    """aiohttp's protocol with a read deadline: from the first byte a client sends (or from
    connecting) until its request is read, at most `timeout_s`, or `auth_timeout_s` while the
    connection has made no authorised request; otherwise the connection is closed. aiohttp times
    out idle connections between requests, not slow heads or bodies."""

    def __init__(self, inner, timeout_s, connections, *, auth_timeout_s=None, write_timeout_s=30.0, metrics=None):
        self.inner, self.timeout_s, self.connections = inner, timeout_s, connections
        self.auth_timeout_s = auth_timeout_s
        self.write_timeout_s, self.metrics = write_timeout_s, metrics
        self.write_timer = None
        self.authenticated = auth_timeout_s is None  # no token: every connection is
        self.timer = None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        self.connections[transport] = self
        self.arm()
        self.inner.connection_made(transport)

    def arm(self):
        if self.timer is None:
            limit = self.timeout_s if self.authenticated else min(self.timeout_s, self.auth_timeout_s)
            self.timer = asyncio.get_running_loop().call_later(limit, self.transport.abort)

    def request_read(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def response_ready(self):
        """The next request's deadline starts now: bytes of it may already be here (pipelined in
        the same packet as this one), and no more may ever come to re-arm it. So a connection
        gets `timeout_s`, not aiohttp's longer keep-alive, to send its next request whole."""
        self.request_read()
        self.arm()

    def data_received(self, data):
        self.arm()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.request_read()
        if self.write_timer is not None:
            self.write_timer.cancel()
        self.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self):
        # the client stopped reading and the send buffer is full: it has write_timeout_s to resume
        if self.write_timer is None:
            self.write_timer = asyncio.get_running_loop().call_later(self.write_timeout_s, self._write_timed_out)
        self.inner.pause_writing()

    def resume_writing(self):
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        self.inner.resume_writing()

    def _write_timed_out(self):
        if self.metrics is not None:
            self.metrics.count("write_timeouts")
        self.transport.abort()  # frees the unsent response at once


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


MAX_NUMBER_CHARS = 100  # a JSON number longer than this is refused (Python's int() of 4,300+ digits raises)


def _bounded_number(text: str):
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return text


def parse_body(raw: bytes):
    """The JSON of a request body; every malformed body is an HTTPError 400 naming why."""
    try:  # UTF-8 only (json.loads of bytes would also take UTF-16 and UTF-32)
        return json.loads(raw.decode("utf-8"), parse_int=lambda t: int(_bounded_number(t)),
                          parse_float=lambda t: float(_bounded_number(t))) if raw else None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"invalid JSON body: line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise HTTPError(400, "invalid JSON body: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise HTTPError(400, f"invalid JSON body: {e}") from None


class FairTurns:
    """At most `capacity` calls at once, granted round robin over requests: each request (key) gets
    one call in before any request gets a second, whatever order they queued in."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.running = 0
        self.queues: collections.OrderedDict[Any, collections.deque] = collections.OrderedDict()

    @contextlib.asynccontextmanager
    async def turn(self, key):
        if self.running < self.capacity and not self.queues:
            self.running += 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            self.queues.setdefault(key, collections.deque()).append(waiter)
            try:
                await waiter  # running was counted for us by whoever handed the turn over
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._release()  # granted as we were cancelled: pass it on
                else:
                    self._forget(key, waiter)
                raise
        try:
            yield
        finally:
            self._release()

    def _forget(self, key, waiter):
        queue = self.queues.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self.queues[key]

    def _release(self):
        self.running -= 1
        while self.queues and self.running < self.capacity:
            key, queue = next(iter(self.queues.items()))
            waiter = queue.popleft()
            del self.queues[key]
            if queue:
                self.queues[key] = queue  # to the back of the rotation
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)
