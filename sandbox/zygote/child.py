"""What a call's or a session's process does once cloned, as root: read its code, confine itself
(its own mounts and /proc, name, session, fds, rlimits, uid, seccomp), then run the code; a
session then loops over the cells it is sent. Any failure before the code starts exits without
a word on the setup pipe, so the supervisor reports "internal".
Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import _signal  # signal's C module: signal.signal's enum conversions cost ~30 copied pages a call
import fcntl
import os
import resource
import signal
import time

from . import cgroups
from . import confine
from . import wire
from . import usercode as zygote_usercode
from .confine import CLONE_NEWCGROUP, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG
from .splice import CELL_HEADER
from .state import CALL_NAME, CELL_FD, DONE_FD, SESSION_NAME, SETUP_FD
from .usercode import main_namespace, make_streams, run_user_code

def enter_call(cpu_seconds, zygote, slot, code_fd, stdin_fd, out_w, err_w, setup_w):
    """In the cloned child, as root: read the code (spliced into `code_fd` by the worker, which never
    read it; stdin likewise into `stdin_fd`, the call's fd 0), confine, drop privileges, run the
    code. Never returns.

    Any failure before user code starts exits without having written to the setup pipe: the
    supervisor reports it as "internal". Once the pipe is closed, nothing the code does can.
    """
    try:
        code = _read_all(code_fd).decode("utf-8", "surrogatepass")
    except BaseException as e:  # noqa: BLE001
        os.write(err_w, f"sandbox setup failed: unreadable job ({type(e).__name__})\n".encode())
        os._exit(1)
    # born in the slot's cgroup, where its forker lives (forker_loop): nothing to join
    _confine_or_exit(zygote, name=CALL_NAME, uid=zygote.settings.uid_base + slot, join_cgroup=None,
                     in_cgroup=zygote.runtime.forker_in_cgroup, cpu_seconds=cpu_seconds,
                     fds=(stdin_fd, out_w, err_w, setup_w))
    zygote = None  # the forker's data is not the code's business
    exit_code = 1
    try:
        exit_code = run_user_code(code, None, zygote_usercode.CALL_STREAMS)
    finally:  # whatever escapes, this process ends here: never in the sandbox's own code
        os._exit(exit_code)


def _read_all(fd):
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def enter_session(zygote, uid, cgroup_fds, out_w, err_w, setup_w, cell_r, done_w):
    """A session's process: confined like a call, then a loop running the cells it is sent.

    Cells arrive on CELL_FD ({"code", "stdin"}); after each, every other process of the session
    is killed (nothing but the interpreter's state outlives a cell) and one byte goes to DONE_FD:
    b"0" (ran) or b"1" (raised). Both fds are the code's to misuse, which can only confuse its
    own session; statuses other than ok/error still come from the kernel.

    This loop runs in the interpreter the cells run in, so a cell can change what it does for
    later cells of the same session (patch run_user_code, os._exit, the done byte): it can make
    its own later cells report ok/error and output text of its choosing, which its code could
    choose anyway (a try/except does as much). It cannot forge timeout, memory, output_limit,
    killed or an ended session (the worker decides those from the kernel), keep a process or a
    thread alive into a later cell, or run between cells: the worker checks from outside that
    the interpreter is single-threaded and waiting for its next cell, then stops it and kills
    every other process of its namespace (sessions.freeze_between_cells). The functions
    it cleans up with are bound here, before any cell, so that the plain replacement of
    os.kill / os.waitpid by a cell does not stall this loop (the outside kill is the guarantee).
    """
    kill, waitpid, exit_now = os.kill, os.waitpid, os._exit
    _confine_or_exit(zygote, name=SESSION_NAME, uid=uid, join_cgroup=cgroup_fds, in_cgroup=bool(cgroup_fds),
                     cpu_seconds=None,
                     fds=(os.open("/dev/null", os.O_RDONLY), out_w, err_w, setup_w, cell_r, done_w))
    zygote = None
    namespace = main_namespace()
    while True:
        header = wire.read_exact(CELL_FD, CELL_HEADER.size)
        body = header and wire.read_exact(CELL_FD, CELL_HEADER.unpack(header)[0])
        if body is None:
            exit_now(0)
        split = len(body) - CELL_HEADER.unpack(header)[1]
        stdin = os.memfd_create("stdin", 0)
        os.write(stdin, body[split:])
        os.lseek(stdin, 0, os.SEEK_SET)
        os.dup2(stdin, 0)
        os.close(stdin)
        code, body = body[:split].decode("utf-8", "surrogatepass"), None
        try:
            exit_code = run_user_code(code, namespace, make_streams())
        except BaseException:  # noqa: BLE001 - nothing of the cell runs on in the session's loop
            exit_now(1)
        code = None
        if os.getpid() == 1:  # strict: kill(-1) is every other process of the session's own namespace
            try:  # (never without that namespace: there kill(-1) would reach every process of the uid)
                kill(-1, signal.SIGKILL)
            except OSError:
                pass
        while os.getpid() == 1:  # reap them (orphans are ours too, as PID 1): no zombie outlives the call either
            try:
                waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        if _thread_count() > 1:
            # A thread the cell started would keep running (and writing) into later cells, and a
            # thread cannot be killed alone: the interpreter ends here, with the cell's result.
            os.write(DONE_FD, CELL_LEFT_THREADS[exit_code != 0])
            exit_now(0)
        os.write(DONE_FD, b"0" if exit_code == 0 else b"1")


CELL_LEFT_THREADS = (b"2", b"3")  # a session's done byte (ran / raised) when the cell left threads running


def _thread_count(settle_s=0.1):
    """Threads of this process, once those that are finishing have gone (a joined thread's OS
    thread exits just after join() returns), waiting at most `settle_s`."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            n = len(os.listdir("/proc/self/task"))
        except OSError:  # no /proc: assume the worst
            return 2
        if n == 1 or time.monotonic() > deadline:
            return n
        time.sleep(0.002)


def _confine_or_exit(zygote, **kwargs):
    """_confine, then report "R" on the setup pipe and close it; on any failure exit without it."""
    try:
        _confine(zygote, **kwargs)
        os.write(SETUP_FD, b"R")
        os.close(SETUP_FD)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        finally:
            os._exit(1)


def _set_name(name):
    """This process's name in /proc/<pid>/comm (its own /proc, in strict isolation)."""
    try:
        fd = os.open("/proc/self/comm", os.O_WRONLY)
        try:
            os.write(fd, name.encode())
        finally:
            os.close(fd)
    except OSError:  # no /proc here
        confine.set_process_name(name)


def _confine(zygote, *, name, uid, join_cgroup, in_cgroup, cpu_seconds, fds):
    """The confinement of a call or session process (runs as root in the fresh child).

    name: the process's name (/proc/<pid>/comm), CALL_NAME or SESSION_NAME.
    join_cgroup: the dir fds of a cgroup to move into (a session's), or None (a call: born in its slot's).
    in_cgroup: whether a cgroup bounds this process's memory and processes (else rlimits do).
    fds: (stdin, stdout, stderr, setup pipe, extra...) placed at 0, 1, 2, SETUP_FD, SETUP_FD + 1, ...

    Each ctypes call here costs ~20 copied pages in every call (its machinery's objects), so the
    name is written through /proc and no_new_privs is set only where the worker has not already
    (it is inherited, and cannot be unset).
    """
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    strict = zygote.settings.strict
    if join_cgroup:
        cgroups.join(join_cgroup)
    if strict and name == SESSION_NAME:  # its own cgroup as "/" (a call is born in its forker's namespace)
        confine.unshare(CLONE_NEWCGROUP)
    if strict:
        confine.mount_call_filesystems(uid, zygote.settings.limits["tmpfs_bytes"], zygote.runtime.rebind)
        workdir = "/tmp"
    else:
        workdir = zygote.runtime.workdir
    _set_name(name)
    if strict:
        confine.seal_call_proc()
    os.setsid()  # own session and process group: kill(0, ...) reaches only this call
    # Move the fds up first: a source may already sit on a target number (e.g. a pipe on fd 4).
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(fds), 1 << 16)
    os.chdir(workdir)
    if _signal.getsignal(_signal.SIGPIPE) != _signal.SIG_DFL:  # a call inherits the forker's default
        _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    limits = zygote.settings.limits
    rl = [
        (resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if cpu_seconds is not None:
        rl.append((resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1)))
    if not in_cgroup:  # without a cgroup: per-process limits are all there is
        address_space = zygote.runtime.address_space_base + limits["memory_bytes"]
        rl.append((resource.RLIMIT_AS, (address_space, address_space)))
        if strict:
            rl.append((resource.RLIMIT_NPROC, (limits["processes"],) * 2))
    for which, value in rl:
        resource.setrlimit(which, value)
    if strict:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # The kernel clears the parent-death signal when the uid changes: set again, so that a call
        # or a session dies with its worker (a session stopped between cells would not even see its
        # cell pipe close; a sleeping call would hold its slot's cgroup with no one to answer to).
        # (A worker that dies in the microseconds between setuid and this line leaves the call
        # running until its CPU limit or its slot's next use: the window is not closed.)
        confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if not (strict and zygote.settings.worker_seccomp is not None):  # else the worker set it (worker_loop)
        confine.prctl(PR_SET_NO_NEW_PRIVS, 1)
    if zygote.settings.seccomp is not None and not strict:  # strict: the worker's filter, inherited (see confine)
        confine.load_seccomp(zygote.settings.seccomp)
    if os.environ:  # a call inherits the forker's, already empty
        os.environ.clear()

