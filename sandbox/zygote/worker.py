"""A worker: one per slot and kind (light, heavy), forked by the master. It reads a job's header
from its job pipe, serves it (a call, or a session's open / cell / close) and sends the result,
publishing its phase in a page it shares with the master (WorkerState), which answers the
running call when the worker dies. The job's data never passes through its memory.
Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import mmap
import os
import select
import signal
import socket
import struct

from . import confine
from . import wire
from . import closer as zygote_closer
from . import forker as zygote_forker
from .confine import CLONE_NEWNET, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG
from .sessions import close_session, kill_session, open_session, run_cell
from .splice import send_result
from .supervise import execute, fail

def worker_loop(slot, kind, job_fd, result_fd, zygote):
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The master's page of every worker's phase and job id stays shared with the master alone: the
    # worker's forker, its calls and its sessions are made without it (a call that could write it
    # would make the master leave a dead worker's call unanswered; issue 79).
    zygote.runtime.state_page.madvise(mmap.MADV_DONTFORK)
    # What only the master uses, out of the copy the forker, its calls and the sessions inherit: the
    # host's cgroup paths, the service's pipe numbers, the work root (which names the service's pid).
    zygote.settings.cgroups = zygote.settings.channels = None
    if zygote.settings.strict:
        zygote.settings.work_root = None
    if zygote.settings.strict:
        confine.unshare(CLONE_NEWNET)  # abstract unix sockets are per network namespace: one per slot
        if zygote.settings.worker_seccomp is not None:
            confine.prctl(PR_SET_NO_NEW_PRIVS, 1)
            confine.load_seccomp(zygote.settings.worker_seccomp)
    slot_fds = zygote.runtime.cgroup_slot_fds[slot] if zygote.runtime.cgroup_slot_fds else None
    for i, fds in enumerate(zygote.runtime.cgroup_slot_fds or []):
        if i != slot:
            for fd in fds.values():
                os.close(fd)
    zygote.runtime.cgroup_fds = slot_fds
    if zygote.runtime.closer_fd is not None:
        zygote_closer.CLOSER.append(socket.socket(fileno=zygote.runtime.closer_fd))
    zygote_forker.FORKER.append(zygote_forker.Forker(zygote, slot))
    if zygote.runtime.proc_fd is not None:  # the forker's alone (a replacement forker goes without)
        os.close(zygote.runtime.proc_fd)
        zygote.runtime.proc_fd = None
    counter = 0
    sessions = {}
    state = WorkerState(zygote.runtime.state_page, slot, kind)
    while True:
        state.set(IDLE)
        select.select([job_fd], [], [])  # idle until a job arrives: nothing of it consumed yet
        state.set(READING)
        job = wire.read_msg(job_fd)  # the header only: its body stays on the pipe, moved by splice
        if job is None:
            for session in list(sessions.values()):
                kill_session(session, zygote)
            os._exit(0)
        if "cancel" in job:
            continue  # for a job that already finished
        counter += 1
        state.set(RUNNING, job.get("id"))
        _serve_one(job, zygote, slot, counter, job_fd, result_fd, sessions, state)
        job = None  # the next call is forked from this frame: it must not find this job here


def _serve_one(job, zygote, slot, counter, job_fd, result_fd, sessions, state):
    """Run one job and send its result. Its header lives only in this frame; its data never in
    this process (module docstring)."""
    op = job.get("op", "run")
    out = err = None
    try:
        if op == "run":
            header, out, err = execute(job, zygote, slot, counter, job_fd)
        elif op == "session_open":
            header = open_session(job, zygote, slot, sessions)
        elif op == "session_run":
            header, out, err = run_cell(job, zygote, sessions, job_fd)
        elif op == "session_close":
            header = close_session(job, zygote, sessions)
        elif op == "ping":  # the pool putting a slot back in step (pool.ZygotePool._reclaim)
            header = {"status": "ok", "exit_code": 0, "duration_s": 0.0, "truncated": False, "notes": []}
        else:
            header = fail(f"unknown op {op!r}")
    except Exception as e:  # noqa: BLE001 - a broken call must not take the worker down
        if job.get("body") and not job.get("body_moved"):
            state.set(READING)  # its body may still be on the job pipe: the master restarts the zygote
            os._exit(3)
        header = fail(repr(e))
    header["id"] = job.get("id")
    state.set(WRITING)
    try:
        send_result(result_fd, header, out.kept if out else (None, 0), err.kept if err else (None, 0))
    finally:
        for sink in (out, err):
            if sink is not None:
                sink.close()


# What a worker is doing, in a page it shares with the master (which reads it when the worker dies).
IDLE, READING, RUNNING, WRITING = 0, 1, 2, 3
KINDS = ("light", "heavy")
_STATE = struct.Struct("<qB")


class WorkerState:
    def __init__(self, page, slot, kind):
        self.page, self.offset = page, 16 * (2 * slot + KINDS.index(kind))

    def set(self, phase, job_id=-1):
        _STATE.pack_into(self.page, self.offset, -1 if job_id is None else int(job_id), phase)

    def get(self):
        job_id, phase = _STATE.unpack_from(self.page, self.offset)
        return phase, job_id
