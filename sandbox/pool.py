"""ZygotePool: the service side of one zygote process (see zygote/main.py), for asyncio.

Creates the per-slot cgroups (sandbox.zygote.cgroups; falls back to rlimits with a warning where
cgroups are not writable), starts `python -I zygote/main.py` with an empty environment and one pair
of pipes per worker slot, waits for it to report ready (or the reason it could not isolate
itself), then hands jobs to idle slots. If the zygote dies, in-flight jobs are retried once on a
fresh zygote, so a crash loses nothing; a job that kills two zygotes in a row gets status
"internal". A caller that is cancelled (its HTTP client went away) has its call killed, and the
slot is handed on only once the worker has answered, so slots never fall out of step.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import re
import subprocess
import sys
from typing import Sequence

from sandbox.zygote import confine
from sandbox.zygote import wire
from sandbox.zygote.cgroups import CgroupTree
from sandbox.result import ExecResult, Limits
from sandbox.zygote.state import CALL_NAME  # /proc/<pid>/comm of a running call

log = logging.getLogger("sandbox")
ZYGOTE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote/start.py")
DEFAULT_PRELOAD = ("math", "fractions", "itertools", "numpy", "sympy")
# The zygote's whole environment (calls clear theirs). glibc's malloc then asks for transparent huge
# pages for its heap (where the kernel offers them "madvise"), so the processes forked per call
# copy and tear down fewer page-table entries: +3-5% trivial calls/s over HTTP, measured alternating.
ZYGOTE_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
DEFAULT_WARMUP = """
import sympy
x, y = sympy.symbols("x y")
sympy.factor(x**2 - 1); sympy.simplify(sympy.sin(x)**2 + sympy.cos(x)**2); sympy.solve(x**2 - 2, x)
sympy.Rational(1, 3) + sympy.sqrt(2); sympy.expand((x + y)**3); sympy.integrate(x**2, x); sympy.isprime(97)
"""


# A job's answer is awaited at most its timeout plus this (see ZygotePool.answer_bound_s); then
# the call is answered worker_died and the slot is put back in step (ZygotePool._reclaim).
ANSWER_GRACE_S = 30.0
SESSION_START_S = 30.0  # zygote/sessions.open_session waits this long for a session to start
ANSWER_LOST_NOTE = ("WorkerDied: the sandbox process running this code gave no answer within {bound:.0f} s (it died "
                    "unseen or hangs); the call was not completed")


class SandboxStartError(RuntimeError):
    pass


class _ZygoteDied(Exception):
    pass


class _AnswerLost(Exception):
    """No answer came within the job's bound (answer_bound_s): its worker died unseen or hangs."""

    def __init__(self, pending: asyncio.Future):
        super().__init__("no answer within the job's bound")
        self.pending = pending  # the read still waiting for an answer (reclaim reads it, never a second reader)


async def _read_result(reader: asyncio.StreamReader) -> dict:
    """A worker's result: its header, then the stdout and stderr bytes it announces (decoded here,
    in the service: the worker never holds them), with the worker's notes after stderr."""
    msg = await wire.read_msg_async(reader)
    stdout = (await reader.readexactly(msg.get("stdout", 0))).decode("utf-8", "replace")
    stderr = (await reader.readexactly(msg.get("stderr", 0))).decode("utf-8", "replace")
    for note in msg.pop("notes", ()):
        stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + note + "\n"
    msg["stdout"], msg["stderr"] = stdout, stderr
    return msg


def _send_settings(pipe, data: bytes):
    try:
        pipe.write(data)
        pipe.close()
    except BrokenPipeError:  # the zygote died at once: its start-up report says why
        pass


def _encode_job(header: dict, code: str | None = None, stdin: str | None = None) -> bytes:
    """A job header and its body, which the worker moves without reading: the code's UTF-8 bytes,
    then stdin's ("body": the total, "stdin": the second part's length). surrogatepass: a lone
    surrogate (valid JSON from a client, invalid UTF-8) must not fail the call."""
    if code is None:
        return wire.encode({**header, "body": 0, "stdin": 0})
    code_bytes = code.encode("utf-8", "surrogatepass")
    stdin_bytes = (stdin or "").encode("utf-8", "surrogatepass")
    sizes = {"body": len(code_bytes) + len(stdin_bytes), "stdin": len(stdin_bytes)}
    return wire.encode({**header, **sizes}) + code_bytes + stdin_bytes


HEAVY_MODULES = ("numpy", "sympy")
# A call goes to the slot's heavy worker (numpy and sympy loaded) when its code names one of these;
# otherwise to the light one (standard library only), which forks ~2 ms faster. A miss costs time,
# never correctness: a light call that imports sympy after all just imports it.
_HEAVY_NAMES = re.compile(r"\b(numpy|sympy|np|sp|mpmath|scipy|sym)\b")


def needs_heavy(code: str) -> bool:
    return _HEAVY_NAMES.search(code) is not None


class _Slot:
    """One execution slot: a light and (if numpy/sympy are preloaded) a heavy worker; one call at a time."""

    def __init__(self, index, channels):
        self.index = index
        self.channels = channels  # {kind: (reader, writer)}
        self.busy_kind = None     # the worker the slot's current job went to
        self.pending = None       # a cancelled caller's unfinished read of that job's answer

    def pick(self, code, op) -> str:
        if "heavy" in self.channels and (op != "run" or needs_heavy(code or "")):
            return "heavy"
        return "light"


class _FreeSlots:
    """Idle worker slots. take() hands out any; take(i) waits for slot i (a session lives there).
    A slot coming free goes to someone waiting for it specifically before anyone else."""

    def __init__(self):
        self.free: dict[int, _Slot] = {}
        self._any: collections.deque[asyncio.Future] = collections.deque()
        self._one: dict[int, collections.deque[asyncio.Future]] = collections.defaultdict(collections.deque)

    def clear(self):
        self.free.clear()

    def put(self, slot: _Slot):
        for waiters in (self._one.get(slot.index), self._any):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(slot)
                    return
        self.free[slot.index] = slot

    async def take(self, index: int | None = None) -> _Slot:
        if index is None and self.free:
            return self.free.pop(next(iter(self.free)))
        if index is not None and index in self.free:
            return self.free.pop(index)
        fut = asyncio.get_running_loop().create_future()
        (self._any if index is None else self._one[index]).append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.put(fut.result())  # it was handed to us just as we were cancelled
            raise


class SessionLost(RuntimeError):
    """The session's worker (or the whole zygote) restarted: its interpreter state is gone."""


class ZygotePool:
    def __init__(self, workers: int, *, isolation: str, preload: Sequence[str], limits: Limits,
                 sessions_memory_bytes: int, uid_base: int | None = None, warmup: str = DEFAULT_WARMUP,
                 startup_timeout_s: float = 120.0, answer_grace_s: float = ANSWER_GRACE_S):
        self.workers = workers
        self.isolation = isolation
        self.preload = tuple(preload)
        self.limits = limits
        self.uid_base = uid_base
        self.sessions_memory_bytes = sessions_memory_bytes
        self.warmup = warmup if "sympy" in self.preload else ""
        self.startup_timeout_s = startup_timeout_s
        self.answer_grace_s = answer_grace_s
        self.proc: subprocess.Popen | None = None
        self.zygote_pid: int | None = None
        self._idle = _FreeSlots()
        self._generation = 0
        self._restart_lock = asyncio.Lock()
        self._ids = itertools.count()
        self._transports = []
        self._cgroups: CgroupTree | None = None
        self.work_root = f"/tmp/rstar2-sandbox-{os.getpid()}-{id(self):x}"  # basic isolation's work dirs
        self._reclaims: set[asyncio.Task] = set()
        # What the running zygote reports it enforces (also in /health).
        self.protections: dict = {}

    def _make_cgroups(self):
        if self.isolation != "strict":
            return None, "cgroups are used with strict isolation only"
        return CgroupTree.create(self.workers, memory_bytes=self.limits.memory_bytes,
                                 processes=self.limits.processes, cpus=self.limits.cpus,
                                 sessions_memory_bytes=self.sessions_memory_bytes)

    async def start(self):
        loop = asyncio.get_running_loop()
        heavy = [m for m in self.preload if m in HEAVY_MODULES]
        light = [m for m in self.preload if m not in HEAVY_MODULES]
        kinds = ["light", "heavy"] if heavy else ["light"]
        parent_fds, child_fds, channels = [], [], []
        for _ in range(self.workers):
            slot_channels, slot_parent = {}, {}
            for kind in kinds:
                job_r, job_w = os.pipe()
                res_r, res_w = os.pipe()
                slot_channels[kind] = [job_r, res_w]
                child_fds += [job_r, res_w]
                slot_parent[kind] = (job_w, res_r)
            channels.append(slot_channels)
            parent_fds.append(slot_parent)
        status_r, status_w = os.pipe()
        cgroup_note = ""
        if self._cgroups is None:
            self._cgroups, cgroup_note = self._make_cgroups()
        # The seccomp filters are built here, not in the zygote: libseccomp's binding imports
        # threading and random, whose fork handlers would then run in every call (~0.2 ms each).
        seccomp = {name: program.hex() if program is not None else None
                   for name, program in (("seccomp", confine.seccomp_program()),
                                         ("worker_seccomp", confine.seccomp_program(for_worker=True)))}
        cfg = dict(channels=channels, status_fd=status_w, light_preload=light, heavy_preload=heavy, **seccomp,
                   isolation=self.isolation, uid_base=self.uid_base,
                   work_root=self.work_root, warmup=self.warmup,
                   limits=self.limits.to_dict(), cgroups=self._cgroups.to_dict() if self._cgroups else None)
        # The settings go on stdin, not argv: a call is a clone of the zygote and could read its
        # command line (/proc/self/cmdline).
        self.proc = subprocess.Popen([sys.executable, "-I", ZYGOTE_SCRIPT],
                                     pass_fds=child_fds + [status_w], env=ZYGOTE_ENV, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
        for fd in child_fds + [status_w]:
            os.close(fd)
        await asyncio.to_thread(_send_settings, self.proc.stdin, json.dumps(cfg).encode())
        try:
            status_reader = await self._reader(loop, status_r)
            status = await asyncio.wait_for(wire.read_msg_async(status_reader), self.startup_timeout_s)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            self.proc.kill()
            err = self.proc.stderr.read().decode(errors="replace")[-2000:] if self.proc.stderr else ""
            raise SandboxStartError(f"sandbox zygote did not start: {err or 'no output'}") from None
        if not status.get("ready"):
            self.proc.wait()
            raise SandboxStartError(f"sandbox zygote could not start ({self.isolation} isolation): "
                                    f"{status.get('error')}")
        self.zygote_pid = status["pid"]
        self.protections = {
            "isolation": self.isolation,
            "cgroups": self._cgroups.version if self._cgroups else None,
            "seccomp": bool(status.get("seccomp")),
            "minimal_root": bool(status.get("minimal_root")),
        }
        if cgroup_note and self.isolation == "strict":
            log.warning("sandbox: per-call cgroups are NOT active (%s); memory, processes and CPU are "
                        "limited per process (rlimits), so a call that forks multiplies them", cgroup_note)
        if not self.protections["seccomp"]:
            log.warning("sandbox: no seccomp filter (pyseccomp or the system's libseccomp is missing)")
        log.info("sandbox zygote %d ready: %s", self.zygote_pid, self.protections)
        self._idle.clear()  # slots of a dead zygote (callers waiting keep waiting for new ones)
        self._generation += 1
        for index, pairs in enumerate(parent_fds):
            slot_channels = {}
            for kind, (job_w, res_r) in pairs.items():
                reader = await self._reader(loop, res_r)
                transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(job_w, "wb", 0))
                self._transports.append(transport)
                slot_channels[kind] = (reader, transport)
            self._idle.put(_Slot(index, slot_channels))

    async def _reader(self, loop, fd) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit=1 << 26)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(fd, "rb", 0))
        self._transports.append(transport)
        return reader

    async def run(self, code: str, stdin: str, timeout: float) -> ExecResult:
        for attempt in range(2):
            generation = self._generation
            slot = await self._idle.take()
            job_id = next(self._ids)
            try:
                result = ExecResult.from_dict(await self._run_on(slot, job_id, code, stdin, timeout))
            except _AnswerLost as lost:
                self._reclaim_later(slot, job_id, generation, lost.pending, cancel=False)
                return ExecResult(status="worker_died", stderr=ANSWER_LOST_NOTE.format(bound=self.answer_bound_s(timeout)))
            except _ZygoteDied:
                await self._restart(generation)
                if attempt == 0:
                    log.warning("sandbox zygote died during a call; retrying it on a fresh zygote")
                    continue
                return ExecResult.internal("the sandbox zygote died twice while running this code")
            except asyncio.CancelledError:
                self._reclaim_later(slot, job_id, generation)
                raise
            self._idle.put(slot)
            return result
        raise AssertionError("unreachable")

    def slot_is_free(self, index: int) -> bool:
        return index in self._idle.free

    async def session_op(self, op: str, slot_index: int | None, generation: int | None, **fields) -> tuple[dict, int, int]:
        """One session job on the slot that owns the session (any slot to open one).

        Returns (the worker's result message, slot index, generation). Raises SessionLost if the zygote restarted since
        `generation` (the session's process died with it).
        """
        if generation is not None and generation != self._generation:
            raise SessionLost("the sandbox restarted; the session's state is gone")
        generation = self._generation
        slot = await self._idle.take(slot_index)
        if generation != self._generation:
            self._idle.put(slot)
            raise SessionLost("the sandbox restarted; the session's state is gone")
        job_id = next(self._ids)
        try:
            result = await self._run_on(slot, job_id, op=op, **fields)
        except _AnswerLost as lost:  # the session's process is in an unknown state: it is gone for the caller
            self._reclaim_later(slot, job_id, generation, lost.pending, cancel=False)
            raise SessionLost("the sandbox worker holding the session did not answer; the session's state is "
                              "gone") from None
        except _ZygoteDied:
            await self._restart(generation)
            raise SessionLost("the sandbox zygote died; the session's state is gone") from None
        except asyncio.CancelledError:
            self._reclaim_later(slot, job_id, generation)
            raise
        self._idle.put(slot)
        return result, slot.index, generation

    async def _run_on(self, slot: _Slot, job_id, code=None, stdin=None, timeout=None, **extra) -> dict:
        slot.busy_kind = kind = slot.pick(code, extra.get("op", "run"))  # sessions: always heavy
        reader, writer = slot.channels[kind]
        try:
            writer.write(_encode_job({"id": job_id, "timeout": timeout, **extra}, code, stdin))
        except (ConnectionError, BrokenPipeError, OSError) as e:
            raise _ZygoteDied() from e
        # Read as a task of its own: a caller cancelled, or a bound passed, mid-answer leaves the
        # read running (never half a message consumed), and the reclaim goes on with that same read.
        pending = asyncio.ensure_future(_read_result(reader))
        try:
            done, _ = await asyncio.wait({pending}, timeout=self.answer_bound_s(timeout))
        except asyncio.CancelledError:
            slot.pending = pending
            raise
        if not done:
            raise _AnswerLost(pending)
        try:
            msg = pending.result()
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, OSError) as e:
            raise _ZygoteDied() from e
        if msg.get("id") != job_id:
            raise _ZygoteDied()
        return msg

    def answer_bound_s(self, timeout: float | None) -> float:
        """How long a job's answer may take: its timeout (a session's open waits up to its 30 s
        start) plus answer_grace_s, more than a live worker ever needs past the deadline (a stuck
        clone is given up FORK_STUCK_S after it, then output and memory are settled in seconds)."""
        return (SESSION_START_S if timeout is None else float(timeout)) + self.answer_grace_s

    def _reclaim_later(self, slot: _Slot, job_id, generation, pending=None, *, cancel=True):
        task = asyncio.create_task(self._reclaim(slot, job_id, generation, pending or slot.pending, cancel=cancel))
        slot.pending = None
        self._reclaims.add(task)  # held here: a task nobody references may be collected mid-way
        task.add_done_callback(self._reclaims.discard)

    async def _reclaim(self, slot: _Slot, job_id, generation, pending, *, cancel):
        """The slot back in step after its caller gave up on `job_id` (cancel: stop the call) or its
        answer did not come in time: every answer up to `job_id`'s, or to a ping's, is read and
        discarded, within a bound. A worker that died without an answer (the master only answers
        for a worker it saw running a call) answers the ping from its successor: the slot is whole
        again. A slot silent past the bound gets a fresh zygote."""
        reader, writer = slot.channels[slot.busy_kind]
        ping_id = next(self._ids)
        try:
            writer.write((wire.encode({"cancel": job_id}) if cancel else b"")
                         + _encode_job({"id": ping_id, "op": "ping", "timeout": 0.0}))
            deadline = asyncio.get_running_loop().time() + self.answer_bound_s(0.0)
            waiting = {job_id, ping_id}
            while ping_id in waiting:
                read = pending if pending is not None else asyncio.ensure_future(_read_result(reader))
                pending = None
                done, _ = await asyncio.wait({read}, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
                if not done:
                    read.cancel()
                    raise TimeoutError(f"slot {slot.index} answered nothing within {self.answer_bound_s(0.0)} s")
                waiting.discard(read.result().get("id"))
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, OSError, TimeoutError) as e:
            log.warning("sandbox: slot %d out of step (%s); restarting the zygote", slot.index, e)
            await self._restart(generation)
            return
        if generation == self._generation:
            self._idle.put(slot)

    async def _restart(self, generation):
        async with self._restart_lock:
            if generation != self._generation:
                return  # someone else already restarted it
            await self.close(restarting=True)
            await self.start()

    async def close(self, *, restarting=False):
        """Stop the zygote. A final close also ends reclaims and frees the cgroups and work root;
        a restart keeps them for the next zygote (and lets reclaims of old slots run out)."""
        if not restarting:
            for task in list(self._reclaims):
                task.cancel()
        for transport in self._transports:
            transport.close()
        self._transports = []
        if self.proc is not None and self.proc.poll() is None:
            try:  # job pipes closed: workers exit, then the zygote
                await asyncio.to_thread(self.proc.wait, 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        if restarting:
            return
        if os.path.isdir(self.work_root):
            try:
                os.rmdir(self.work_root)
            except OSError:
                log.warning("sandbox: %s is not empty after close", self.work_root)
        if self._cgroups is not None:
            await asyncio.to_thread(self._cgroups.remove)
            self._cgroups = None


def child_pids(pid: int) -> list[int]:
    """The pids of a process's children (its main thread's), [] once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def process_name(pid: int) -> str | None:
    """A process's name (/proc/<pid>/comm: zygote/state.CALL_NAME, FORKER_NAME, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def running_calls(worker_pid: int) -> list[int]:
    """The calls a zygote worker is running now: its children named CALL_NAME (its forker, the
    one other child, is not one). For tests and benchmarks that inject faults."""
    return [pid for pid in child_pids(worker_pid) if process_name(pid) == CALL_NAME]
