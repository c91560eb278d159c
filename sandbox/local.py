"""LocalSandbox: the embedded asyncio execution pool.

    async with sandbox.LocalSandbox(workers=4) as sb:
        result = await sb.run("print(2 ** 10)")
        results = await sb.run_many([{"code": "1 + 1"}, {"code": "input()", "stdin": "x"}])

isolation="strict" (default) needs root or CAP_SYS_ADMIN (namespaces, uid switch) and refuses to
start without it; isolation="basic" runs with rlimits only and warns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import warnings
from typing import Any, Iterable, Sequence

from sandbox import uids
from sandbox.pool import DEFAULT_PRELOAD, SandboxStartError, SessionLost, ZygotePool
from sandbox.result import ExecResult, Limits, validate_request

log = logging.getLogger("sandbox")


class SessionLimitError(RuntimeError):
    """max_sessions sessions are open and none closed within the wait."""


def check_strict_isolation_available() -> str | None:
    """None if strict isolation can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "strict isolation needs root (namespaces, a per-call uid); run as root or use isolation='basic'"
    for ns in ("net", "pid", "mnt", "ipc"):
        if not os.path.exists(f"/proc/self/ns/{ns}"):
            return f"this kernel has no {ns} namespaces; use isolation='basic'"
    return None


ISOLATION_MODES = ("strict", "basic")


class LocalSandbox:
    def __init__(self, workers: int = 4, *, isolation: str = "strict", limits: Limits | None = None,
                 preload: Sequence[str] = DEFAULT_PRELOAD, default_timeout: float = 5.0,
                 max_pending: int = 4096, uid_base: int | None = None, max_sessions: int = 256,
                 session_idle_timeout_s: float = 600.0, session_wait_s: float = 5.0,
                 sessions_memory_bytes: int | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be 'strict' or 'basic', got {isolation!r}")
        self.workers = workers
        self.isolation = isolation
        self.limits = limits = Limits() if limits is None else limits
        self.default_timeout = default_timeout
        # All sessions' memory together, idle ones included (cgroups only): a quarter of the host's
        # memory unless given. Past it the kernel ends one session (its next cell says so).
        if sessions_memory_bytes is None:
            sessions_memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        self._pool = ZygotePool(workers, isolation=isolation, preload=preload, limits=limits,
                                sessions_memory_bytes=sessions_memory_bytes)
        # The slots' uids, then one per session: a block no other sandbox on this host holds,
        # claimed at start and freed at close (sandbox/uids.py); uid_base pins where it starts.
        self._uid_base = uid_base
        self._uids: uids.UidRange | None = None
        self._pending = asyncio.Semaphore(max_pending)  # backpressure: callers past this wait
        self.in_flight = 0
        self._started = False
        # Sessions: each gets its own uid (after the slots' uids), returned when it closes.
        self.max_sessions = max_sessions
        self.session_idle_timeout_s = session_idle_timeout_s
        self.session_wait_s = session_wait_s  # at the cap: how long session() waits for one to close
        self._session_uids: asyncio.Queue[int] | None = None
        self._sessions: dict[int, "Session"] = {}
        self._session_ids = itertools.count()
        self._reaper: asyncio.Task | None = None

    async def start(self) -> "LocalSandbox":
        if self.isolation == "strict":
            reason = check_strict_isolation_available()
            if reason:
                raise SandboxStartError(reason)
        else:
            warnings.warn("sandbox isolation='basic': rlimits only; code can reach the network, "
                          "see other processes and read the filesystem", RuntimeWarning, stacklevel=2)
        self._uids = uids.claim(self.workers + self.max_sessions, self._uid_base)
        self._pool.uid_base = self._uids.base
        try:
            await self._pool.start()
        except BaseException:
            self._uids.close()
            raise
        self._session_uids = asyncio.Queue()
        for k in range(self.max_sessions):
            self._session_uids.put_nowait(self._pool.uid_base + self.workers + k)
        self._reaper = asyncio.create_task(self._close_idle_sessions())
        self._started = True
        return self

    async def session(self, wait_s: float | None = None) -> "Session":
        """A stateful interpreter for one trajectory (see Session). If max_sessions are open, waits
        up to `wait_s` (default: session_wait_s) for one to close, then raises SessionLimitError."""
        if not self._started:
            raise RuntimeError("LocalSandbox is not started: use `async with LocalSandbox(...) as sb`")
        wait_s = self.session_wait_s if wait_s is None else wait_s
        try:
            uid = await asyncio.wait_for(self._session_uids.get(), wait_s)
        except asyncio.TimeoutError:
            raise SessionLimitError(
                f"all {self.max_sessions} sessions of this sandbox are open (waited {wait_s:g} s for one to "
                f"close): close finished ones (`async with await sb.session() as s:`), raise max_sessions, "
                f"or lower session_idle_timeout_s (now {self.session_idle_timeout_s:g} s)") from None
        session = Session(self, uid, next(self._session_ids))
        self._sessions[session.id] = session
        return session

    def _least_loaded_slot(self) -> int:
        """Where a new session's interpreter goes: the slot holding the fewest live ones (sessions
        pin their slot for every cell), a free one among those if any."""
        counts = [0] * self.workers
        for session in self._sessions.values():
            if session._slot is not None:
                counts[session._slot] += 1
        fewest = [i for i, n in enumerate(counts) if n == min(counts)]
        free = [i for i in fewest if self._pool.slot_is_free(i)]
        return (free or fewest)[0]

    def _release_session(self, session: "Session"):
        if self._sessions.pop(session.id, None) is not None:
            self._session_uids.put_nowait(session.uid)

    async def _close_idle_sessions(self):
        while True:
            await asyncio.sleep(min(5.0, self.session_idle_timeout_s / 4))
            now = time.monotonic()
            for session in list(self._sessions.values()):
                if now - session.last_used > self.session_idle_timeout_s and not session._lock.locked():
                    log.info("sandbox: closing session %d after %.0f s idle", session.id, now - session.last_used)
                    await session.close()

    async def __aenter__(self) -> "LocalSandbox":
        return await self.start()

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._started:
            self._started = False
            if self._reaper is not None:
                self._reaper.cancel()
            for session in list(self._sessions.values()):
                session.closed = True  # their processes end with the zygote
                self._release_session(session)
            try:
                await self._pool.close()
            finally:
                self._uids.close()

    @property
    def protections(self) -> dict:
        """What the running zygote enforces: isolation, cgroups ("v1" | "v2" | None), seccomp, minimal_root."""
        return dict(self._pool.protections)

    @property
    def zygote_pid(self) -> int | None:
        """PID of the zygote (its /proc/PID/root shows the calls' private /tmp)."""
        return self._pool.zygote_pid

    def validate(self, code: Any, stdin: Any = "", timeout: Any = None) -> float:
        """Check one request; returns the timeout to use. Raises ValueError with the reason."""
        return validate_request(code, stdin, timeout, default_timeout=self.default_timeout,
                                max_timeout=self.limits.max_timeout_s)

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        if not self._started:
            raise RuntimeError("LocalSandbox is not started: use `async with LocalSandbox(...) as sb`")
        timeout = self.validate(code, stdin, timeout)
        async with self._pending:
            self.in_flight += 1
            try:
                return await self._pool.run(code, stdin, timeout)
            finally:
                self.in_flight -= 1

    async def run_many(self, requests: Iterable[dict[str, Any]]) -> list[ExecResult]:
        """Run requests ({"code", "stdin"?, "timeout"?}) concurrently; results in request order."""
        return list(await asyncio.gather(*(self.run(r["code"], r.get("stdin", ""), r.get("timeout"))
                                           for r in requests)))


class Session:
    """A live, isolated interpreter for one trajectory: variables persist from call to call.

        async with sb.session() as s:
            await s.run("x = 21")
            (await s.run("x * 2")).stdout   # '42\n'

    Each call is confined and limited exactly like a stateless one (its own PID, IPC, mount and
    network namespaces, cgroup, uid, seccomp); between calls every process but the interpreter is
    killed. A timeout, memory kill or output flood ends the interpreter: that result says so, and
    the next call starts a fresh one. Closed at the end of the `async with`, or after
    `idle_timeout_s` without calls.
    """

    def __init__(self, sb: "LocalSandbox", uid: int, session_id: int):
        self._sb, self.uid, self.id = sb, uid, session_id
        self._slot: int | None = None
        self._generation: int | None = None
        self._lock = asyncio.Lock()
        self.last_used = time.monotonic()
        self.closed = False
        self.restarts = 0  # interpreters started after the first (state lost each time)

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        timeout = self._sb.validate(code, stdin, timeout)
        if self.closed:
            raise RuntimeError("the session is closed")
        async with self._lock, self._sb._pending:
            self.last_used = time.monotonic()
            note = ""
            for _ in range(2):
                if self._slot is None:
                    if self._generation is not None:
                        self.restarts += 1
                    await self._open()
                try:
                    msg, _, _ = await self._sb._pool.session_op("session_run", self._slot, self._generation,
                                                                session=self.id, code=code, stdin=stdin, timeout=timeout)
                except SessionLost:
                    self._slot = None
                    note = "[the sandbox restarted: this session's earlier variables are gone]\n"
                    continue
                if msg.get("session_ended"):
                    self._slot = None
                result = ExecResult.from_dict(msg)
                if note:
                    result = dataclasses.replace(result, stderr=note + result.stderr)
                self.last_used = time.monotonic()
                return result
            return ExecResult.internal("the sandbox restarted twice while running this session's call")

    async def _open(self):
        msg, slot, generation = await self._sb._pool.session_op("session_open", self._sb._least_loaded_slot(), None,
                                                                session=self.id, uid=self.uid)
        if msg["status"] != "ok":
            raise SandboxStartError(msg["stderr"])
        self._slot, self._generation = slot, generation

    async def close(self):
        if self.closed:
            return
        self.closed = True
        async with self._lock:
            if self._slot is not None:
                try:
                    await self._sb._pool.session_op("session_close", self._slot, self._generation, session=self.id)
                except SessionLost:
                    pass
                self._slot = None
        self._sb._release_session(self)
