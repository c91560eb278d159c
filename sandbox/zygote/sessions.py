"""Sessions: a live interpreter per trajectory, owned by the worker that opened it. A session's
process is confined like a call (plus its own network namespace and cgroup) and runs the cells
it is sent; a cell's end is believed only once the kernel shows the interpreter idle between
cells.
Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import os
import select
import signal
import time

from . import cgroups
from . import confine
from . import wire
from .confine import CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID
from .child import CELL_LEFT_THREADS, enter_session
from .closer import hold_mount_namespace
from .splice import Sink, devnull, forward_cell, splice_exact
from .state import CELL_FD
from .supervise import fail, remove_tree, result_header

class Session:
    def __init__(self, pid, pidfd, cell_w, done_r, out_r, err_r, cgroup_name, cgroup_fds):
        self.pid, self.pidfd, self.cell_w, self.done_r = pid, pidfd, cell_w, done_r
        self.out_r, self.err_r = out_r, err_r
        self.cgroup_name, self.cgroup_fds = cgroup_name, cgroup_fds
        self.proc_fd = None  # its /proc/<pid> directory (see open_proc_dir), where the kernel allows
        self.proc_root = None  # strict: the /proc of its own PID namespace (every process it started)
        self.stopped = False  # SIGSTOPped between cells (freeze_between_cells)

    def fds(self):
        return tuple(fd for fd in (self.pidfd, self.cell_w, self.done_r, self.out_r, self.err_r, self.proc_fd,
                                   self.proc_root) if fd is not None)


# The end of a cell is the byte the session's loop writes to DONE_FD, which the cell's own code
# could write too (same process). So the worker believes it only once the kernel agrees: the
# interpreter has one thread and is blocked reading its next cell (/proc/<pid>/syscall: read on
# CELL_FD). A cell that writes the byte early is waited for; its late output stays its own.

def open_proc_dir(pid, pidfd, strict):
    """(O_DIRECTORY fd of the session process's /proc entry, fd of the /proc of its PID namespace),
    either None where it cannot be had. Strict: its /proc is only mounted in its own mount
    namespace (the worker has none), so the worker steps into that namespace to open /proc and
    /proc/1 (the session is PID 1 there) and straight back. Without strict isolation there is no
    namespace of its own (None)."""
    if not strict:
        try:
            return os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY), None
        except OSError:
            return None, None
    own_pidfd = os.pidfd_open(os.getpid())
    own = hold_mount_namespace(own_pidfd)
    os.close(own_pidfd)
    if own is None:
        return None, None  # a kernel without the ioctl: the done byte is trusted as before
    try:
        theirs = hold_mount_namespace(pidfd)
        if theirs is None:
            return None, None
        confine.setns(theirs, CLONE_NEWNS)
        os.close(theirs)
        try:
            root = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
            return os.open("1", os.O_RDONLY | os.O_DIRECTORY, dir_fd=root), root
        finally:
            try:
                confine.setns(own, CLONE_NEWNS)
            except OSError:
                os._exit(3)  # never serve another call from a session's file system
    except OSError:
        return None, None
    finally:
        os.close(own)


# Between cells nothing of a session runs: once the kernel shows a cell finished, the worker stops
# the interpreter (SIGSTOP, which a PID-namespace init cannot refuse from its parent namespace) and
# kills every other process of its namespace from outside, so neither a timer or signal handler the
# cell installed nor a child it kept alive (its os.kill replaced) spends CPU or writes output while
# the session sits idle or another client's call runs on the slot. The next cell continues it.
FREEZE_WAIT_S = 1.0


def freeze_between_cells(session):
    """Stop the session's interpreter and kill the other processes of its namespace (strict)."""
    try:
        signal.pidfd_send_signal(session.pidfd, signal.SIGSTOP)
    except ProcessLookupError:
        return
    session.stopped = True
    deadline = time.monotonic() + FREEZE_WAIT_S
    while time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, session.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT) is not None:
                break
        except ChildProcessError:
            return
        time.sleep(0.0005)
    if session.proc_root is not None:
        kill_namespace_but_init(session.proc_root, deadline)


def kill_namespace_but_init(proc_root, deadline):
    """SIGKILL every live process of a PID namespace but its PID 1, through `proc_root` (that
    namespace's /proc: an fd of /proc/<pid> is a pidfd), until none is left or `deadline`."""
    while time.monotonic() < deadline:
        alive = 0
        for name in os.listdir(proc_root):
            if not name.isdigit() or name == "1":
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc_root)
            except OSError:
                continue  # gone meanwhile
            try:
                if _state(fd) != b"Z":
                    alive += 1
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        if not alive:
            return
        time.sleep(0.0005)


def _state(proc_dir_fd):
    """A process's state letter from its /proc/<pid>/stat (after the parenthesised name)."""
    fd = os.open("stat", os.O_RDONLY, dir_fd=proc_dir_fd)
    try:
        return os.read(fd, 512).rsplit(b")", 1)[1].split()[0]
    finally:
        os.close(fd)


def thaw(session):
    if session.stopped:
        try:
            signal.pidfd_send_signal(session.pidfd, signal.SIGCONT)
        except ProcessLookupError:
            pass
        session.stopped = False


def _settles_idle(proc_fd, within_s=1.0):
    """True once a fresh session shows as idle_between_cells (it is about to wait for its first cell)."""
    deadline = time.monotonic() + within_s
    while not idle_between_cells(proc_fd):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def idle_between_cells(proc_fd):
    """True when the session's interpreter is single-threaded and blocked reading CELL_FD."""
    try:
        task = os.open("task", os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc_fd)
        try:
            if len(os.listdir(task)) != 1:
                return False
        finally:
            os.close(task)
        fd = os.open("syscall", os.O_RDONLY, dir_fd=proc_fd)
        try:
            fields = os.read(fd, 256).split()
        finally:
            os.close(fd)
        return len(fields) > 1 and fields[0] == str(confine.SYS_READ).encode() and int(fields[1], 16) == CELL_FD
    except (OSError, ValueError):
        return False


def open_session(job, zygote, slot, sessions):
    """Start a session's process (confined like a call, plus its own network namespace and cgroup)."""
    started = time.monotonic()
    uid = job["uid"]
    name = f"session-{uid}"
    cgroup_fds = None
    runtime = zygote.runtime
    if runtime.cgroup_sessions_fds:
        cgroups.remove_child(runtime.cgroup_sessions_fds, name, {})  # a leftover of a killed worker, if any
        cgroup_fds = cgroups.make_child(runtime.cgroup_version, runtime.cgroup_sessions_fds, name,
                                        zygote.settings.limits)
    mine, theirs = [], []
    for _ in range(4):  # out, err, setup, cell (ours: read, read, read, write)
        r, w = os.pipe()
        mine.append(r if len(mine) != 3 else w)
        theirs.append(w if len(theirs) != 3 else r)
    done_r, done_w = os.pipe()
    out_r, err_r, setup_r, cell_w = mine
    out_w, err_w, setup_w, cell_r = theirs
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS | CLONE_NEWNET if zygote.settings.strict else 0
    if not zygote.settings.strict:
        zygote.runtime.workdir = os.path.join(zygote.settings.work_root, name)
        os.makedirs(zygote.runtime.workdir, 0o700, exist_ok=True)
    pid = confine.clone(flags)
    if pid == 0:
        enter_session(zygote, uid, cgroup_fds, out_w, err_w, setup_w, cell_r, done_w)
    for fd in (out_w, err_w, setup_w, cell_r, done_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([setup_r], [], [], 30.0)
    ok = bool(ready) and os.read(setup_r, 1) == b"R"
    os.close(setup_r)
    session = Session(pid, pidfd, cell_w, done_r, out_r, err_r, name, cgroup_fds)
    if ok:
        session.proc_fd, session.proc_root = open_proc_dir(pid, pidfd, zygote.settings.strict)
        if session.proc_fd is not None and not _settles_idle(session.proc_fd):
            # the kernel does not show it waiting for its first cell (no /proc/<pid>/syscall, say):
            # the check cannot be made here, and the done byte is trusted as before
            os.close(session.proc_fd)
            session.proc_fd = None
    if not ok:
        os.set_blocking(err_r, False)
        try:  # our own setup code's message (no code has run): small, and not user data
            err = os.read(err_r, 4096).decode(errors="replace")
        except BlockingIOError:
            err = ""
        kill_session(session, zygote)
        return fail(f"the session did not start: {err}", time.monotonic() - started)
    sessions[job["session"]] = session
    return {"status": "ok", "exit_code": 0, "duration_s": time.monotonic() - started, "truncated": False, "notes": []}


def kill_session(session, zygote):
    try:
        os.kill(session.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(session.pid, 0)
    except ChildProcessError:
        pass
    _close_session_fds(session, zygote)


def run_cell(job, zygote, sessions, job_fd):
    """One cell in a live session. A timeout, output flood, OOM or cancellation ends the session
    (its state is gone: the result says so); the next cell on it gets a fresh one from the service.
    The cell's body goes from the job pipe to the session's cell pipe and its output into memfds,
    by splice: never through this process. Returns (header, stdout sink, stderr sink)."""
    body = int(job.get("body", 0))
    session = sessions.get(job["session"])
    if session is None:
        splice_exact(job_fd, devnull(), body)
        job["body_moved"] = True
        return fail("no such session (it was closed or its worker restarted)"), None, None
    limits = zygote.settings.limits
    started = time.monotonic()
    oom_before = cgroups.oom_kills(zygote.runtime.cgroup_version, session.cgroup_fds) if session.cgroup_fds else 0
    out, err = Sink(session.out_r, limits["stdout_bytes"]), Sink(session.err_r, limits["stderr_bytes"])
    sinks = {session.out_r: out, session.err_r: err}
    reason = wait_status = done = None
    thaw(session)
    if not forward_cell(job_fd, session.cell_w, body, int(job.get("stdin", 0))):
        reason = "ended"
    job["body_moved"] = True
    deadline = started + float(job["timeout"])
    watch_jobs = True
    while reason is None and done is None:
        now = time.monotonic()
        if now >= deadline:
            reason = "timeout"
            break
        watch = [session.pidfd, session.done_r, session.out_r, session.err_r] + ([job_fd] if watch_jobs else [])
        ready, _, _ = select.select(watch, [], [], deadline - now)
        for fd in ready:
            if fd == session.pidfd:
                reason = "ended"
            elif fd == session.done_r:
                done = os.read(session.done_r, 1)
                if not done:  # EOF: the interpreter is gone
                    reason = "ended"
            elif fd == job_fd:
                msg = wire.read_msg(job_fd)
                if msg is None or msg.get("cancel") == job["id"]:
                    reason = "cancelled"
                    watch_jobs = False  # what follows a cancel (the pool's ping) is the next job's
            elif sinks[fd].drain():
                reason = "output_limit"
    if done in (b"0", b"1") and reason is None and session.proc_fd is not None:
        done, reason = _confirm_done(session, sinks, deadline, done)
    if done in (b"0", b"1") and reason is None:
        freeze_between_cells(session)  # before the last drain: what it wrote until stopped is this cell's
    for sink in sinks.values():
        sink.drain()  # what was written before the cell finished (or the session died)
    if reason is None and any(sink.size > sink.cap for sink in sinks.values()):
        reason = "output_limit"  # decided by the bytes, as for calls (see result_header), even if it finished
    duration = time.monotonic() - started
    if done in (b"0", b"1") and reason is None:
        return _cell_header(done == b"1", duration), out, err
    if done in CELL_LEFT_THREADS and reason in (None, "ended"):  # it ended itself, as it said: the cell's result
        kill_session(sessions.pop(job["session"]), zygote)
        note = ("[the cell left threads running; the session's interpreter was ended so that they cannot write "
                "into later cells: earlier variables are gone]")
        return _cell_header(done == CELL_LEFT_THREADS[1], duration, note, session_ended=True), out, err
    # The session is over: kill it (if still alive), collect how it ended, free it.
    try:
        os.kill(session.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, wait_status, rusage = os.wait4(session.pid, 0)
    oom = (cgroups.oom_kills(zygote.runtime.cgroup_version, session.cgroup_fds) - oom_before) if session.cgroup_fds else 0
    header = result_header(wait_status, None if reason == "ended" else reason, job, duration, setup_done=True,
                     oom_kills=oom, cpu_s=0.0, over_cap=out.size > out.cap or err.size > err.cap)
    if reason == "ended" and os.WIFEXITED(wait_status):
        header["status"] = "error"  # the code ended its own interpreter (exit(), os._exit)
    header["notes"].append("[the session's interpreter has ended: earlier variables are gone]")
    header["session_ended"] = True
    sessions.pop(job["session"])
    _close_session_fds(session, zygote)
    return header, out, err


def _cell_header(raised, duration, *notes, **extra):
    """The result header of a cell that ran to its end (ok, or error when it raised)."""
    return {"status": "error" if raised else "ok", "exit_code": int(raised), "duration_s": duration,
            "truncated": False, "notes": list(notes), **extra}


def _confirm_done(session, sinks, deadline, done):
    """(done byte, reason) once the kernel agrees the cell is over (idle_between_cells), draining
    its output meanwhile; the done byte is the last one written (earlier ones were the cell's)."""
    while not idle_between_cells(session.proc_fd):
        if time.monotonic() >= deadline:
            return None, "timeout"
        ready, _, _ = select.select([session.pidfd, session.out_r, session.err_r], [], [], 0.001)
        if session.pidfd in ready:
            return None, "ended"
        for fd in ready:
            if fd != session.pidfd and sinks[fd].drain():
                return None, "output_limit"
    os.set_blocking(session.done_r, False)
    try:
        written = os.read(session.done_r, 4096)
    except BlockingIOError:
        written = b""
    finally:
        os.set_blocking(session.done_r, True)
    return written[-1:] or done, None


def _close_session_fds(session, zygote):
    for fd in session.fds():
        try:
            os.close(fd)
        except OSError:
            pass
    if session.cgroup_fds is not None:
        cgroups.remove_child(zygote.runtime.cgroup_sessions_fds, session.cgroup_name, session.cgroup_fds)
    if not zygote.settings.strict:
        remove_tree(os.path.join(zygote.settings.work_root, session.cgroup_name))


def close_session(job, zygote, sessions):
    session = sessions.pop(job["session"], None)
    if session is not None:
        kill_session(session, zygote)
    return {"status": "ok", "exit_code": 0, "duration_s": 0.0, "truncated": False, "notes": []}

