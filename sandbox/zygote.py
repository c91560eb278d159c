"""The zygote: a warm Python process that forks one isolated process per code execution.

Standard library (plus pyseccomp), run as a script (`python -I zygote.py ...`) with an empty
environment by `sandbox.pool.ZygotePool`; it imports nothing of the rest of the package, so
nothing of the service is inside the processes that run untrusted code.

Process tree (strict isolation):

    service (asyncio)  --pipes-->  master zygote  (own mount, network and IPC namespaces; pivot_root
                                    |               into a minimal read-only root: /usr, the
                                    |               interpreter, /dev/{null,zero,full,random,urandom})
                                    +-- worker i, light  (one per slot, standard library only) and
                                    +-- worker i, heavy  (numpy, sympy, ... imported): each in its own
                                          |          network namespace, reads a job, supervises one
                                          |          call at a time; the slot runs one call at a time
                                          +-- forker (forked once by the worker: clones each call, and
                                          |          sleeps in the kernel while it lives, see Forker)
                                          +-- call (cloned by the forker as the worker's child:
                                                    clone(NEWPID|NEWIPC|NEWNS): PID 1 of a fresh PID
                                                    namespace with its own SysV IPC / mqueues, its own
                                                    /tmp, /dev/shm and /proc; in the slot's cgroup;
                                                    uid `uid_base + i`; rlimits; seccomp; empty env)

Why this shape:
- Forking from the warm worker costs a few ms; a fresh interpreter with sympy costs 300+ ms.
- Nothing survives a call: when PID 1 of the call's namespace exits the kernel kills every
  process in it (setsid daemons, double forks), and the call's tmpfs, IPC objects and mount
  namespace go with the last of them. There is nothing to clean up, so cleanup cannot fail.
- One uid and one network namespace per worker slot: concurrent calls cannot reach each other's
  files, processes or abstract unix sockets.
- The result (status, exit code, timing) is decided here from what the kernel reports (exit
  status, rusage, the cgroup's OOM counter) and a setup pipe closed before user code starts;
  nothing the code prints or exits with can forge a status.

Wire format on every pipe: 4-byte big-endian length + UTF-8 JSON, a header that holds no user
data, followed by raw bytes it announces. To a worker: a job header {"id", "op", "timeout", "body": n,
"stdin": k, ...} and n bytes of body (the code's UTF-8, then k bytes of stdin), or {"cancel": id} (stop that job if it is still
running). From a worker: a result header {"id", "status", "exit_code", "duration_s", "truncated",
"notes", "stdout": n1, "stderr": n2} and n1 + n2 bytes of output.

No process that forks calls or sessions ever holds a call's data (an earlier call's code, stdin
or output would otherwise be in every later call's memory, which the call can read): a worker
moves a job's body from its job pipe into two memfds (code, stdin) with splice(2), kernel to
kernel, and hands the memfds to its forker; the call reads its code from there after the fork
(stdin is its fd 0); the call's output goes through pipes into memfds, and from there onto the
result pipe, by splice as well. A cell goes to a session the same way. The bytes never pass
through the worker's or the forker's (Python) memory.

A worker that dies (the OOM killer's first choice; every sandbox process volunteers) is noticed at
once by the master (wait(2)), which answers the call it was running with status "worker_died" on
its result pipe and starts a new worker on the same pipes: the slot keeps serving. Each worker
publishes what it is doing in a page shared with the master (idle, reading a job, running job id,
writing its result); a death while reading or writing could leave half a message on a pipe, so
then the master exits and the service starts a new zygote instead (the window is microseconds).
"""

import _signal  # signal's C module: signal.signal's enum conversions cost ~30 copied pages a call
import ast
import builtins
import fcntl
import io
import json
import linecache
import mmap
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves out the script's dir
import cgroups  # noqa: E402 - siblings, imported as top-level modules (no package inside the zygote)
import confine  # noqa: E402
import wire  # noqa: E402

sys.path.pop(0)
from confine import (  # noqa: E402
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_PARENT,
    CLONE_PARENT_SETTID,
    CLONE_VFORK,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
)

USER_FILE = "<code>"
EOF_GRACE_S = 2.0  # after the call exits, how long to wait for its pipes to close
SETUP_FD = 3       # inside the call: written once ("R") when confinement is complete, then closed
CELL_FD = 4        # inside a session: cells to run
DONE_FD = 5        # inside a session: one byte per finished cell
OOM_SCORE_ADJ = 1000  # the sandbox's processes are the kernel OOM killer's first choice


# ------------------------------------------------------------------------------------------------
# the zygote's state: what the service decided, and what each process found or opened


class Settings:
    """What the service decided for this zygote (the JSON on argv, see ZygotePool.start): fixed for
    its life and the same in every worker, forker, call and session."""

    __slots__ = ("channels", "status_fd", "strict", "limits", "work_root", "uid_base", "seccomp",
                 "worker_seccomp", "light_preload", "heavy_preload", "warmup", "cgroups")

    def __init__(self, raw):
        self.channels = raw["channels"]  # [{kind: [job_fd, result_fd]}] per slot, inherited from the service
        self.status_fd = raw["status_fd"]  # the start-up report's pipe
        self.strict = raw["isolation"] == "strict"
        self.limits = raw["limits"]  # sandbox.result.Limits.to_dict()
        self.work_root = raw["work_root"]  # calls' working directories, without strict isolation
        self.uid_base = raw["uid_base"]  # slot i's calls run as uid_base + i
        # BPF programs, built by the service (libseccomp's binding imports threading: see ZygotePool.start)
        self.seccomp = bytes.fromhex(raw["seccomp"]) if raw["seccomp"] else None
        self.worker_seccomp = bytes.fromhex(raw["worker_seccomp"]) if raw["worker_seccomp"] else None
        self.light_preload = raw["light_preload"]
        self.heavy_preload = raw["heavy_preload"]
        self.warmup = raw.get("warmup")  # code run once before the heavy workers fork
        self.cgroups = raw.get("cgroups")  # sandbox.cgroups tree (paths), or None


class Runtime:
    """What this process found or opened. The master sets the first group before it forks the
    workers, which inherit it; each worker, its forker and each call then set their own (after a
    fork a process's changes are its own: nothing here is shared between processes)."""

    __slots__ = (
        # the master's
        "state_page",  # the page where workers publish their phase (WorkerState)
        "proc_fd",  # /proc, opened before pivot_root (a forker reads its own maps); closed by workers
        "rebind",  # mounts a call must re-bind (confine.covered_by_call_mounts), strict only
        "closer_fd",  # the socket to the closer of mount namespaces, strict only
        "address_space_base",  # the worker's own mappings, under RLIMIT_AS without a cgroup
        "cgroup_version", "cgroup_slot_fds", "cgroup_sessions_fds",  # dir fds of the cgroup tree
        # the worker's, its forker's, a call's
        "cgroup_fds",  # this slot's cgroup
        "forker_in_cgroup",  # the forker joined it: calls are born there
        "workdir",  # this call's or session's working directory, without strict isolation
    )

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, None)
        self.forker_in_cgroup = False


class Zygote:
    """Both halves, passed to every function that needs either."""

    __slots__ = ("settings", "runtime")

    def __init__(self, settings, runtime):
        self.settings, self.runtime = settings, runtime


# ------------------------------------------------------------------------------------------------
# wire format: wire.py (shared with the service)

read_msg, write_msg, _read_exact = wire.read_msg, wire.write_msg, wire.read_exact


def splice_exact(src, dst, n, *, offset_src=None):
    """Move n bytes from src to dst in the kernel (one end a pipe). Never through this process."""
    moved = 0
    while moved < n:
        if offset_src is None:
            step = os.splice(src, dst, n - moved)
        else:
            step = os.splice(src, dst, n - moved, offset_src=offset_src + moved)
        if step == 0:
            raise EOFError(f"end of input after {moved} of {n} bytes")
        moved += step


CELL_HEADER = struct.Struct(">II")  # a cell's body length, and how much of it is stdin


def _forward(job_fd, dst, n, stdin_n):
    """A framed body of n bytes (stdin_n of them stdin) from the job pipe to `dst` (a pipe), by
    splice. If `dst` is gone, the rest is dropped so the job pipe stays at a message boundary;
    False then."""
    moved = 0
    try:
        os.write(dst, CELL_HEADER.pack(n, stdin_n))
        while moved < n:
            step = os.splice(job_fd, dst, n - moved)
            if step == 0:
                raise EOFError("the job pipe closed mid-body")
            moved += step
        return True
    except OSError:
        splice_exact(job_fd, _devnull(), n - moved)
        return False


def send_result(result_fd, header, out=(None, 0), err=(None, 0)):
    """A result header, then the bytes of each (memfd, length): spliced, never read here."""
    write_msg(result_fd, {**header, "stdout": out[1], "stderr": err[1]})
    for fd, n in (out, err):
        if n:
            splice_exact(fd, result_fd, n, offset_src=0)


class _Sink:
    """A call's stream: its pipe's bytes spliced into a memfd, kept up to cap + 1 (the byte past the
    cap proves the overflow); past that, spliced into /dev/null so the writer never blocks."""

    def __init__(self, pipe_r, cap):
        self.pipe_r, self.cap = pipe_r, cap
        os.set_blocking(pipe_r, False)
        self.memfd = os.memfd_create("out", 0)
        self.size = 0
        self.open = True

    def drain(self):
        """Move what the pipe holds now; True once over the cap."""
        while self.open:
            room = self.cap + 1 - self.size
            dst = self.memfd if room > 0 else _devnull()
            try:
                step = os.splice(self.pipe_r, dst, room if room > 0 else 1 << 16, flags=os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                break
            if step == 0:
                self.open = False
                break
            if room > 0:
                self.size += step
        return self.size > self.cap

    @property
    def kept(self):
        return (self.memfd, min(self.size, self.cap))

    def close(self):
        os.close(self.memfd)


_DEVNULL = []


def _devnull():
    if not _DEVNULL:
        _DEVNULL.append(os.open("/dev/null", os.O_WRONLY))
    return _DEVNULL[0]


# ------------------------------------------------------------------------------------------------
# inside the call

def _filter_user_frames(te):
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == USER_FILE])
    for inner in (te.__cause__, te.__context__):
        if inner is not None:
            _filter_user_frames(inner)
    return te


class _TrackingFileIO(io.FileIO):
    """Raw stdout that remembers whether anything reached it (print, sys.stdout.buffer, ...)."""
    wrote = False

    def write(self, b):
        if len(b):
            self.wrote = True
        return super().write(b)


def main_namespace():
    """The globals of a fresh script: those of a real `__main__` module in sys.modules, so that
    pickle finds the code's own functions by reference (multiprocessing.Pool.map over a function
    the snippet defines, ProcessPoolExecutor) as it would in `python script.py`."""
    module = types.ModuleType("__main__")
    # no __file__, as for `python -c`: a "spawn" child would otherwise try to re-run a file that
    # does not exist (and fail in a loop); it is a plain missing-attribute error instead
    module.__dict__.update({"__builtins__": builtins})
    sys.modules["__main__"] = module
    return module.__dict__


def make_streams():
    """(stdin, stdout, stderr, raw stdout) text streams over fds 0, 1 and 2, unused.

    A worker makes one set when it starts (_CALL_STREAMS), and every call it forks starts with
    that set untouched: building them in each call cost ~0.1 ms. A session makes a set per cell."""
    raw_stdout = _TrackingFileIO(1, "w", closefd=False)
    return (io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace"),
            io.TextIOWrapper(io.BufferedWriter(raw_stdout, 16384), encoding="utf-8", errors="backslashreplace"),
            io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                             write_through=True),
            raw_stdout)


_CALL_STREAMS = None  # the worker's set (make_streams), never written to by the worker itself


def run_user_code(code, namespace, streams):
    """Run `code` as a script; repr of a last expression when nothing was printed. Returns exit code.

    namespace: a session's globals, kept from cell to cell (None: a fresh script).
    streams: make_streams()'s, fresh (nothing read or written through them yet)."""
    sys.stdin, sys.stdout, sys.stderr, raw_stdout = streams
    sys.argv = [USER_FILE]
    linecache.cache[USER_FILE] = (len(code), None, code.splitlines(True), USER_FILE)
    if namespace is None:
        namespace = main_namespace()
    exit_code = 0
    try:
        tree = ast.parse(code, USER_FILE)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, USER_FILE, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, USER_FILE, "eval"), namespace)
            sys.stdout.flush()
            if value is not None and not raw_stdout.wrote:
                sys.stdout.write(repr(value) + "\n")
    except SystemExit as e:
        exit_code = _exit_status(e)
    except BaseException as e:  # noqa: BLE001 - the user's exception is the result
        exit_code = 1
        _report(e)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - e.g. the output pipe was closed by the supervisor
            pass
    return exit_code


# The code's objects may raise from __str__, __format__, __repr__, __bool__, __index__, and
# sys.stderr may be anything by now: what follows reports them without calling into the code's
# objects where it can, writes to fd 2 directly, and never lets an exception out (which would
# unwind into the sandbox's own frames and print them).

def _emit(text):
    try:
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(2, data):]
    except BaseException:  # noqa: BLE001 - stderr closed: nothing to report to
        pass


def _exit_status(e):
    """The exit status of SystemExit(code), as Python's own exit would give it."""
    try:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):  # int.__and__ reads the value, never a subclass's methods
            return int.__and__(code, 0xFF)
        _emit(_safe_str(code) + "\n")
    except BaseException:  # noqa: BLE001
        pass
    return 1


def _safe_str(obj):
    try:
        text = str(obj)
        return text if type(text) is str else "<unprintable>"
    except BaseException:  # noqa: BLE001
        return f"<unprintable {type(obj).__name__} object>"


def _report(e):
    """The traceback of the code's exception, its own frames only (by where they were compiled)."""
    try:
        te = _filter_user_frames(traceback.TracebackException.from_exception(e))
        _emit("".join(te.format()))
    except BaseException:  # noqa: BLE001 - a hostile exception: its type's name is all we say
        try:
            _emit(f"{type(e).__name__}: <the exception could not be formatted>\n")
        except BaseException:  # noqa: BLE001
            pass


def _enter_call(cpu_seconds, zygote, slot, code_fd, stdin_fd, out_w, err_w, setup_w):
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
        exit_code = run_user_code(code, None, _CALL_STREAMS)
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


def _enter_session(zygote, uid, cgroup_fds, out_w, err_w, setup_w, cell_r, done_w):
    """A session's process: confined like a call, then a loop running the cells it is sent.

    Cells arrive on CELL_FD ({"code", "stdin"}); after each, every other process of the session
    is killed (nothing but the interpreter's state outlives a cell) and one byte goes to DONE_FD:
    b"0" (ran) or b"1" (raised). Both fds are the code's to misuse, which can only confuse its
    own session; statuses other than ok/error still come from the kernel.
    """
    _confine_or_exit(zygote, name=SESSION_NAME, uid=uid, join_cgroup=cgroup_fds, in_cgroup=bool(cgroup_fds),
                     cpu_seconds=None,
                     fds=(os.open("/dev/null", os.O_RDONLY), out_w, err_w, setup_w, cell_r, done_w))
    zygote = None
    namespace = main_namespace()
    while True:
        header = _read_exact(CELL_FD, CELL_HEADER.size)
        body = header and _read_exact(CELL_FD, CELL_HEADER.unpack(header)[0])
        if body is None:
            os._exit(0)
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
            os._exit(1)
        code = None
        if os.getpid() == 1:  # strict: kill(-1) is every other process of the session's own namespace
            try:  # (never without that namespace: there kill(-1) would reach every process of the uid)
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        while os.getpid() == 1:  # reap them (orphans are ours too, as PID 1): no zombie outlives the call either
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        if _thread_count() > 1:
            # A thread the cell started would keep running (and writing) into later cells, and a
            # thread cannot be killed alone: the interpreter ends here, with the cell's result.
            os.write(DONE_FD, CELL_LEFT_THREADS[exit_code != 0])
            os._exit(0)
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
    if not (strict and zygote.settings.worker_seccomp is not None):  # else the worker set it (worker_loop)
        confine.prctl(PR_SET_NO_NEW_PRIVS, 1)
    if zygote.settings.seccomp is not None and not strict:  # strict: the worker's filter, inherited (see confine)
        confine.load_seccomp(zygote.settings.seccomp)
    if os.environ:  # a call inherits the forker's, already empty
        os.environ.clear()


# ------------------------------------------------------------------------------------------------
# worker: one call at a time

FORK_STUCK_S = 10.0  # no clone this long after a call's deadline: the forker is stuck


def _cpu_seconds(job):
    """A call's RLIMIT_CPU (soft): its wall-clock timeout plus one second."""
    return int(job["timeout"]) + 1


def _signal_name(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def execute(job, zygote, slot, counter, job_fd):
    """Run one job; every fd and directory it makes is released whatever happens. Returns the
    result header and the output sinks (the caller sends them, then closes them)."""
    fds = []
    workdir = None
    try:
        if not zygote.settings.strict:
            workdir = zygote.runtime.workdir = os.path.join(zygote.settings.work_root, f"w{slot}-{counter}")
            os.mkdir(workdir, 0o700)
        code_fd = os.memfd_create("code", 0)
        fds.append(code_fd)
        stdin_fd = os.memfd_create("stdin", 0)
        fds.append(stdin_fd)
        stdin_n = int(job.get("stdin", 0))
        # kernel to kernel: never in this process
        splice_exact(job_fd, code_fd, int(job.get("body", 0)) - stdin_n)
        splice_exact(job_fd, stdin_fd, stdin_n)
        job["body_moved"] = True
        os.lseek(stdin_fd, 0, os.SEEK_SET)  # the offset is shared with the call, whose fd 0 it is
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        setup_r, setup_w = os.pipe()
        fds += [out_r, out_w, err_r, err_w, setup_r, setup_w]
        return _supervise(job, zygote, slot, job_fd, (code_fd, stdin_fd), (out_r, out_w), (err_r, err_w), (setup_r, setup_w),
                          fds)
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if workdir is not None:
            remove_tree(workdir)


def _supervise(job, zygote, slot, job_fd, body_fds, out, err, setup, fds):
    limits = zygote.settings.limits
    started = time.monotonic()
    runtime = zygote.runtime
    oom_before = cgroups.oom_kills(runtime.cgroup_version, runtime.cgroup_fds) if runtime.cgroup_fds else 0
    strict = zygote.settings.strict
    child_fds = (*body_fds, out[1], err[1], setup[1])
    pid = _FORKER[0].fork_call(_cpu_seconds(job), runtime.workdir, child_fds, setup[0],
                               started + float(job["timeout"]))
    for fd in child_fds:
        os.close(fd)
        fds.remove(fd)
    sinks = {out[0]: _Sink(out[0], limits["stdout_bytes"]), err[0]: _Sink(err[0], limits["stderr_bytes"])}
    mount_ns = None
    try:
        pidfd = os.pidfd_open(pid)
        fds.append(pidfd)
        mount_ns = hold_mount_namespace(pidfd) if strict else None
        deadline = started + float(job["timeout"])
        reason = None  # why we killed it: "timeout" | "output_limit" | "cancelled"
        wait_status = rusage = None
        eof_deadline = None
        watch_jobs = True
        while True:
            now = time.monotonic()
            open_fds = [fd for fd, sink in sinks.items() if sink.open]
            if wait_status is None:
                if reason is None and now >= deadline:
                    reason = "timeout"
                    _kill_call(pid, zygote)
                watch = [pidfd, *open_fds] + ([job_fd] if watch_jobs else [])
                wait_s = max(0.0, deadline - now) if reason is None else 0.1
            else:
                # The call is gone (and with it its PID namespace); collect what is left in the pipes.
                if not open_fds or now >= eof_deadline:
                    break
                watch, wait_s = open_fds, eof_deadline - now
            ready, _, _ = select.select(watch, [], [], wait_s)
            for fd in ready:
                if fd == pidfd:
                    _, wait_status, rusage = os.wait4(pid, 0)
                    eof_deadline = time.monotonic() + EOF_GRACE_S
                    continue
                if fd == job_fd:
                    msg = read_msg(job_fd)
                    if msg is None or msg.get("cancel") == job["id"]:
                        if reason is None:
                            reason = "cancelled"
                            _kill_call(pid, zygote)
                        watch_jobs = msg is not None
                    continue
                if sinks[fd].drain() and reason is None and wait_status is None:
                    reason = "output_limit"
                    _kill_call(pid, zygote)
        duration = time.monotonic() - started
        os.set_blocking(setup[0], False)  # never wait here, whoever might still hold the write end
        try:
            setup_done = os.read(setup[0], 1) == b"R"
        except BlockingIOError:
            setup_done = False
        oom = cgroups.oom_kills(runtime.cgroup_version, runtime.cgroup_fds) - oom_before if runtime.cgroup_fds else 0
        cpu_s = rusage.ru_utime + rusage.ru_stime
        out_sink, err_sink = sinks[out[0]], sinks[err[0]]
        header = _result(wait_status, reason, job, duration, setup_done=setup_done, oom_kills=oom, cpu_s=cpu_s,
                         over_cap=out_sink.size > out_sink.cap or err_sink.size > err_sink.cap)
        return header, out_sink, err_sink
    except BaseException:
        for sink in sinks.values():
            sink.close()
        raise
    finally:
        release_mount_namespace(mount_ns)


def _result(wait_status, reason, job, duration, *, setup_done, oom_kills, cpu_s, over_cap):
    """The result header of a finished call: status and notes from what the kernel reported, and
    the output's size: over the cap is "output_limit" whether or not the kill landed before the
    call ended by itself (a race that would otherwise give the same code different statuses)."""
    notes = []
    if not setup_done and reason is None:
        return _fail("the call could not start (its stderr says why)", duration)
    if over_cap and reason != "cancelled":
        reason = "output_limit"
    if os.WIFEXITED(wait_status):
        exit_code = os.WEXITSTATUS(wait_status)
        status = "ok" if exit_code == 0 else "error"
    else:
        sig = os.WTERMSIG(wait_status)
        exit_code = -sig
        if sig == signal.SIGXCPU and cpu_s >= _cpu_seconds(job) - 0.05:  # the kernel's CPU limit, not a self-kill
            status = "timeout"
            notes.append("TimeoutError: CPU time limit exceeded")
        else:
            status = "killed"
            if reason is None and not oom_kills:
                notes.append(f"killed by {_signal_name(sig)}")
    if oom_kills and reason is None:
        status = "memory"
        notes.append("MemoryError: the code exceeded its memory limit")
    if reason == "timeout":
        status = "timeout"
        notes.append(f"TimeoutError: execution exceeded {job['timeout']} s")
    elif reason == "output_limit":
        status = "output_limit"
        notes.append("OutputLimitError: output exceeded the limit")
    elif reason == "cancelled":
        status = "killed"
        notes.append("cancelled: the client went away")
    return {"status": status, "exit_code": exit_code, "duration_s": duration, "truncated": over_cap, "notes": notes}


def _kill_call(pid, zygote):
    try:
        os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the kernel kills everything under it
    except ProcessLookupError:
        pass
    if not zygote.settings.strict:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def remove_tree(path):
    """Delete a directory tree of any depth and any name length; never raises.

    Iterative and relative to directory fds: shutil.rmtree recurses (RecursionError past ~1000
    levels) and absolute paths stop at PATH_MAX. Used only without strict isolation (strict calls'
    files live in a tmpfs that vanishes with the call).
    """
    try:
        stack = [(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW), None, None)]
    except OSError:
        return
    while stack:
        fd, parent_fd, name = stack[-1]
        descended = False
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            child = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                            stack.append((child, fd, entry.name))
                            descended = True
                            break
                        os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
        except OSError:
            pass
        if descended:
            continue
        stack.pop()
        os.close(fd)
        try:
            if parent_fd is None:
                os.rmdir(path)
            else:
                os.rmdir(name, dir_fd=parent_fd)
        except OSError:
            if parent_fd is not None:  # cannot remove it (e.g. not empty after an error): skip it
                try:
                    os.rename(name, f".stuck-{name[:16]}-{time.monotonic_ns()}", src_dir_fd=parent_fd,
                              dst_dir_fd=parent_fd)
                except OSError:
                    pass


# ------------------------------------------------------------------------------------------------
# the forker: the one process that forks calls, and runs no Python while a call lives
#
# Every page a process writes after a fork is copied (or, once the child is gone, re-taken) in a
# page fault; a worker that forked each call and then ran its supervision loop in Python while
# the call ran took ~220 such faults a call. So each worker forks, once, a forker that does
# nothing but clone calls: with CLONE_VFORK it sleeps in the kernel while the call lives, and
# with CLONE_PARENT the call is the worker's child, which the worker supervises (pidfd, wait4)
# without ever having forked it. The forker receives only file descriptors (the call's memfds and
# pipes), never a call's data. Measured: +10% trivial calls/s over HTTP on 2 cores, together with
# warm_up and starting the zygote from bytecode (zygote_start.py).

FORKER_NAME = "sandbox-forker"  # /proc/<pid>/comm of a worker's forker
CALL_NAME = "sandbox-call"      # ... of a call (a worker's other children), and of a session
SESSION_NAME = "sandbox-session"
_FORKER_REQUEST = struct.Struct(">I")  # the call's CPU seconds; then its workdir (not strict), UTF-8
_FORKER = []  # the worker's Forker


class Forker:
    """The worker's handle on its forker process (see above)."""

    def __init__(self, zygote, slot):
        self.zygote, self.slot = zygote, slot
        self.pid_page = mmap.mmap(-1, mmap.PAGESIZE)  # shared: the kernel stores each call's pid here
        self.start()

    def start(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            forker_loop(theirs, self.zygote, self.slot, self.pid_page)
        theirs.close()
        self.sock = ours

    def fork_call(self, cpu_seconds, workdir, child_fds, setup_r, deadline):
        """Have the forker clone a call that inherits `child_fds` (code, stdin, stdout, stderr,
        setup pipe); its pid, once its setup pipe shows it exists. A forker that died is
        replaced and asked again; a clone the kernel refused raises OSError."""
        request = _FORKER_REQUEST.pack(cpu_seconds) + (workdir or "").encode()
        struct.pack_into("<i", self.pid_page, 0, 0)
        try:
            socket.send_fds(self.sock, [request], list(child_fds))
        except OSError:  # the forker is gone (killed from outside): a new one, once
            self.sock.close()
            os.waitpid(self.pid, 0)
            self.start()
            socket.send_fds(self.sock, [request], list(child_fds))
        # A clone takes milliseconds, but a call's deadline may come first (timeout=1e-6): then the
        # clone is still awaited (the supervisor kills the call at once, status "timeout"), and only
        # a forker silent for FORK_STUCK_S past the deadline counts as stuck (a worker lost).
        stuck_at = max(deadline, time.monotonic() + FORK_STUCK_S)
        while True:
            # The call writes "R" to its setup pipe when it is confined, or dies without: either way
            # the kernel stored its pid before it ran. The forker answers only if the clone failed.
            ready, _, _ = select.select([setup_r, self.sock], [], [], max(0.0, stuck_at - time.monotonic()))
            if self.sock in ready:
                reply = self.sock.recv(64)
                if not reply:
                    os._exit(3)  # the forker died mid-clone: the master answers this call worker_died
                raise OSError(int(reply), f"the call could not be started: {os.strerror(int(reply))}")
            (pid,) = struct.unpack_from("<i", self.pid_page, 0)
            if pid:
                return pid
            if not ready:
                os._exit(3)  # no clone long after the call's deadline: a stuck forker, this slot starts afresh


def forker_loop(sock, zygote, slot, pid_page):
    """The forker: clone a call for each request, sleeping (CLONE_VFORK) until it is gone. Never returns."""
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    confine.set_process_name(FORKER_NAME)
    collapse_into_huge_pages(zygote.runtime.proc_fd)
    for closer in _CLOSER:  # closed below, with every fd of the worker's but the calls' cgroup
        closer.detach()
    _CLOSER.clear()
    # Into the slot's cgroup, so that every call is born there. Moving a process between cgroups
    # takes a lock that, after a few ms without moves, first waits for an RCU grace period: a
    # call that joined the cgroup itself paid ~7 ms after any pause (0.1 ms under load).
    zygote.runtime.forker_in_cgroup = bool(zygote.runtime.cgroup_fds)
    if zygote.runtime.cgroup_fds:
        cgroups.join(zygote.runtime.cgroup_fds)
    keep = sorted({0, 1, 2, sock.fileno()})
    for low, high in zip(keep, keep[1:] + [1 << 16]):
        os.closerange(low + 1, high)
    _DEVNULL.clear()
    # what every call would otherwise set for itself (see _confine), inherited: its environment
    # (the OpenBLAS thread settings were read when numpy was imported) and SIGPIPE's default
    os.environ.clear()
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    global _CALL_STREAMS
    warm_up()
    _CALL_STREAMS = make_streams()
    flags = CLONE_VFORK | CLONE_PARENT | CLONE_PARENT_SETTID
    if zygote.settings.strict:
        flags |= CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS
    pid_address = ctypes_address(pid_page)
    while True:
        try:
            request, fds, _, _ = socket.recv_fds(sock, 1 << 16, 5)
        except InterruptedError:
            continue
        if not request:  # the worker is gone
            os._exit(0)
        (cpu_seconds,) = _FORKER_REQUEST.unpack_from(request)
        if not zygote.settings.strict:
            zygote.runtime.workdir = request[_FORKER_REQUEST.size:].decode()
        try:
            pid = confine.clone(flags, pid_address)
        except OSError as e:
            sock.send(str(e.errno).encode())
            pid = None
        if pid == 0:
            _enter_call(cpu_seconds, zygote, slot, *fds)
        for fd in fds:
            os.close(fd)
        request = fds = None


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25


def collapse_into_huge_pages(proc_fd):
    """Back the forker's own anonymous memory with 2 MB pages where they fit, best effort.

    A fork copies, and an exit tears down, one page-table entry per 4 kB page: for a heavy worker's
    ~55 MB that is most of a call's fork and exit. With 2 MB pages it is one entry per 2 MB, and a
    call that writes to one copies its 4 kB as before. The forker sleeps while calls live, so its
    own writes rarely split them; khugepaged (MADV_HUGEPAGE) mends those that are. A kernel
    without transparent huge pages (or set to "never") refuses, and nothing changes."""
    if proc_fd is None:
        return
    try:
        fd = os.open("self/maps", os.O_RDONLY, dir_fd=proc_fd)
        with open(fd) as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue  # private anonymous memory (and the malloc heap) only, never a file's pages
        start, end = (int(x, 16) for x in fields[0].split("-"))
        start = -(-start // HUGE_PAGE) * HUGE_PAGE
        end = end // HUGE_PAGE * HUGE_PAGE
        if end > start:
            confine.madvise(start, end - start, MADV_HUGEPAGE)
            confine.madvise(start, end - start, MADV_COLLAPSE)


def ctypes_address(buffer):
    """The address of a writable buffer's first byte (for the kernel to write to)."""
    import ctypes  # already loaded by confine
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


WARM_UP_CODE = ("x = [i * i for i in range(10)]\nprint(sum(x), 'a', 1.5)\nx",
                "def f(n):\n    return {'n': n + 1}\nprint(f(2)['n'], end='')\nimport sys\nsys.exit(0)",
                "x = [1, 2, 3]\nx[5]")


def warm_up(rounds=12):
    """Run a call's own Python path (parse, compile, exec, print, exit, a traceback) here, before
    forking any: the interpreter then has specialised that code and filled its type cache in this
    process, so each call does not write (and so copy) those pages again. Output goes to
    /dev/null; nothing of it stays. An error here costs speed only."""
    saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
    saved = sys.stdin, sys.stdout, sys.stderr, sys.argv, sys.modules.get("__main__")
    null = os.open("/dev/null", os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for _ in range(rounds):
            for code in WARM_UP_CODE:
                run_user_code(code, None, make_streams())
    except BaseException:  # noqa: BLE001 - only a speed-up
        pass
    finally:
        for fd, old in zip((0, 1, 2), saved_fds):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)
        sys.stdin, sys.stdout, sys.stderr, sys.argv = saved[:4]
        if saved[4] is not None:
            sys.modules["__main__"] = saved[4]
        linecache.cache.pop(USER_FILE, None)


# ------------------------------------------------------------------------------------------------
# a call's mount namespace, freed off the call's path
#
# Freeing a mount namespace unmounts its mounts, and the kernel then waits for an RCU grace
# period (namespace_unlock: synchronize_rcu_expedited), 0.1-1 ms of sleep on a loaded machine.
# When the call's PID 1 exits holding the last reference, that wait comes before the worker can
# reap it, on every call's path. So the worker takes a reference while the call runs, and
# after the call hands it to the zygote's closer process, which drops it (and waits) there.
# Measured: +9% calls/s for trivial calls over HTTP on 2 cores.

PIDFD_GET_MNT_NAMESPACE = 0xFF03  # ioctl on a pidfd (Linux 6.11+): an fd of that process's mount namespace
CLOSER_BATCH = 256
CLOSER_NAME = "sandbox-closer"  # its /proc/<pid>/comm: the zygote's one child that is not a worker
_CLOSER = []  # the worker's end of the closer's socket (socket.socket), if there is a closer


def hold_mount_namespace(pidfd):
    """An fd of the process's mount namespace (a reference that keeps it alive), or None on a
    kernel without the ioctl (a call's own exit then frees its namespace, as before)."""
    try:
        return fcntl.ioctl(pidfd, PIDFD_GET_MNT_NAMESPACE)
    except OSError:
        return None


def release_mount_namespace(ns_fd):
    """Hand the reference to the closer (or, if it is gone, drop it here); never raises."""
    if ns_fd is None:
        return
    try:
        if _CLOSER:
            socket.send_fds(_CLOSER[0], [b"n"], [ns_fd])
    except OSError:
        _CLOSER.clear()  # the closer died: from now on this worker drops its references itself
    os.close(ns_fd)


def closer_loop(sock_fd, batch=CLOSER_BATCH, idle_s=0.05):
    """The closer process: drop the mount-namespace references the workers send, `batch` at a time
    (or whatever it holds after `idle_s` without new ones). Never returns."""
    sock = socket.socket(fileno=sock_fd)
    held = []
    while True:
        if held and (len(held) >= batch or not select.select([sock], [], [], idle_s)[0]):
            for fd in held:
                os.close(fd)
            held.clear()
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 16, 64)
        except InterruptedError:
            continue
        except OSError:
            os._exit(0)
        held += fds
        if not data and not fds:  # every worker's end is closed
            os._exit(0)


# ------------------------------------------------------------------------------------------------
# sessions: a live interpreter per trajectory, owned by the worker that opened it

class _Session:
    def __init__(self, pid, pidfd, cell_w, done_r, out_r, err_r, cgroup_name, cgroup_fds):
        self.pid, self.pidfd, self.cell_w, self.done_r = pid, pidfd, cell_w, done_r
        self.out_r, self.err_r = out_r, err_r
        self.cgroup_name, self.cgroup_fds = cgroup_name, cgroup_fds
        self.proc_fd = None  # its /proc/<pid> directory (see open_proc_dir), where the kernel allows

    def fds(self):
        return tuple(fd for fd in (self.pidfd, self.cell_w, self.done_r, self.out_r, self.err_r, self.proc_fd)
                     if fd is not None)


# The end of a cell is the byte the session's loop writes to DONE_FD, which the cell's own code
# could write too (same process). So the worker believes it only once the kernel agrees: the
# interpreter has one thread and is blocked reading its next cell (/proc/<pid>/syscall: read on
# CELL_FD). A cell that writes the byte early is waited for; its late output stays its own.

def open_proc_dir(pid, pidfd, strict):
    """An O_DIRECTORY fd of the session process's /proc entry, or None. Strict: its /proc is only
    mounted in its own mount namespace (the worker has none), so the worker steps into that
    namespace to open /proc/1 (the session is PID 1 there) and straight back."""
    if not strict:
        try:
            return os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
    own_pidfd = os.pidfd_open(os.getpid())
    own = hold_mount_namespace(own_pidfd)
    os.close(own_pidfd)
    if own is None:
        return None  # a kernel without the ioctl: the done byte is trusted as before
    try:
        theirs = hold_mount_namespace(pidfd)
        if theirs is None:
            return None
        confine.setns(theirs, CLONE_NEWNS)
        os.close(theirs)
        try:
            return os.open("/proc/1", os.O_RDONLY | os.O_DIRECTORY)
        finally:
            try:
                confine.setns(own, CLONE_NEWNS)
            except OSError:
                os._exit(3)  # never serve another call from a session's file system
    except OSError:
        return None
    finally:
        os.close(own)


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


def _fail(message, duration=0.0):
    """The result header of a job the sandbox (not the code) failed."""
    return {"status": "internal", "exit_code": None, "duration_s": duration, "truncated": False,
            "notes": [f"sandbox internal error: {message}"]}


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
        _enter_session(zygote, uid, cgroup_fds, out_w, err_w, setup_w, cell_r, done_w)
    for fd in (out_w, err_w, setup_w, cell_r, done_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([setup_r], [], [], 30.0)
    ok = bool(ready) and os.read(setup_r, 1) == b"R"
    os.close(setup_r)
    session = _Session(pid, pidfd, cell_w, done_r, out_r, err_r, name, cgroup_fds)
    if ok:
        session.proc_fd = open_proc_dir(pid, pidfd, zygote.settings.strict)
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
        _close_session(session, zygote)
        return _fail(f"the session did not start: {err}", time.monotonic() - started)
    sessions[job["session"]] = session
    return {"status": "ok", "exit_code": 0, "duration_s": time.monotonic() - started, "truncated": False, "notes": []}


def _close_session(session, zygote):
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
        splice_exact(job_fd, _devnull(), body)
        job["body_moved"] = True
        return _fail("no such session (it was closed or its worker restarted)"), None, None
    limits = zygote.settings.limits
    started = time.monotonic()
    oom_before = cgroups.oom_kills(zygote.runtime.cgroup_version, session.cgroup_fds) if session.cgroup_fds else 0
    out, err = _Sink(session.out_r, limits["stdout_bytes"]), _Sink(session.err_r, limits["stderr_bytes"])
    sinks = {session.out_r: out, session.err_r: err}
    reason = wait_status = done = None
    if not _forward(job_fd, session.cell_w, body, int(job.get("stdin", 0))):
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
                msg = read_msg(job_fd)
                if msg is None or msg.get("cancel") == job["id"]:
                    reason = "cancelled"
                watch_jobs = msg is not None
            elif sinks[fd].drain():
                reason = "output_limit"
    if done in (b"0", b"1") and reason is None and session.proc_fd is not None:
        done, reason = _confirm_done(session, sinks, deadline, done)
    for sink in sinks.values():
        sink.drain()  # what was written before the cell finished (or the session died)
    if reason is None and any(sink.size > sink.cap for sink in sinks.values()):
        reason = "output_limit"  # decided by the bytes, as for calls (see _result), even if it finished
    duration = time.monotonic() - started
    if done in (b"0", b"1") and reason is None:
        return _cell_header(done == b"1", duration), out, err
    if done in CELL_LEFT_THREADS and reason in (None, "ended"):  # it ended itself, as it said: the cell's result
        _close_session(sessions.pop(job["session"]), zygote)
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
    header = _result(wait_status, None if reason == "ended" else reason, job, duration, setup_done=True,
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
        _close_session(session, zygote)
    return {"status": "ok", "exit_code": 0, "duration_s": 0.0, "truncated": False, "notes": []}


def worker_loop(slot, kind, job_fd, result_fd, zygote):
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
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
        _CLOSER.append(socket.socket(fileno=zygote.runtime.closer_fd))
    _FORKER.append(Forker(zygote, slot))
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
        job = read_msg(job_fd)  # the header only: its body stays on the pipe, moved by splice
        if job is None:
            for session in list(sessions.values()):
                _close_session(session, zygote)
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
        else:
            header = _fail(f"unknown op {op!r}")
    except Exception as e:  # noqa: BLE001 - a broken call must not take the worker down
        if job.get("body") and not job.get("body_moved"):
            state.set(READING)  # its body may still be on the job pipe: the master restarts the zygote
            os._exit(3)
        header = _fail(repr(e))
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


def _vm_size(status_fd):
    os.lseek(status_fd, 0, os.SEEK_SET)
    for line in os.read(status_fd, 1 << 16).decode().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------------------------------
# master

def interpreter_dirs():
    """The interpreter's own directories (prefixes hold the stdlib and site-packages); never the
    script's directory or other sys.path entries (an editable install points into the repo).

    Each at its resolved path and, where a symbolic link leads to it (`.venv -> /elsewhere/.venv`),
    also at the path the interpreter was started by: sys.path names site-packages by the latter."""
    prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.realpath(sys.executable)))
    dirs = sorted({form(p) for p in prefixes if p and os.path.isdir(p) for form in (os.path.realpath, os.path.abspath)})
    kept = []
    for d in dirs:
        if not any(d.startswith(k + "/") for k in kept):
            kept.append(d)
    return kept


def isolate_master(zygote):
    """Namespaces and the minimal root shared by all calls of this zygote (made once)."""
    confine.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC)
    confine.mount(None, "/", None, confine.MS_REC | confine.MS_PRIVATE)
    needed = interpreter_dirs()
    zygote.runtime.rebind = confine.covered_by_call_mounts(needed)
    root = confine.root_mount_point(needed)
    # a fresh tmpfs over an existing directory (in this mount namespace only)
    confine.mount("tmpfs", root, "tmpfs", confine.MS_NOSUID | confine.MS_NODEV, "size=1m,mode=0755")
    confine.build_minimal_root(root, needed)
    confine.enter_root(root)


def start_closer():
    """Fork the closer (see release_mount_namespace); the fd of the socket workers send to."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        confine.set_process_name(CLOSER_NAME)
        os.dup2(theirs.detach(), 3)
        os.closerange(4, 1 << 16)  # nothing of the service's pipes: they close when the zygote's do
        closer_loop(3)
    theirs.close()
    return ours.detach()


def main():
    """Start-up order matters: namespaces and the minimal root first, then light workers (forked
    while only the light modules are imported), then numpy/sympy (imported from inside the
    minimal root), then heavy workers. A call is forked from a light or heavy worker of its slot
    (the service routes by the modules the code names): forking a process with sympy and numpy
    loaded costs ~2.4 ms of page-table copying, one with the standard library ~0.5 ms."""
    zygote = Zygote(Settings(json.loads(sys.argv[1])), Runtime())
    channels = zygote.settings.channels  # [{kind: [job_fd, result_fd]}] per slot, inherited from the service
    status_fd = zygote.settings.status_fd
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    facts = {}
    workers = {}  # pid -> (slot, kind)
    zygote.runtime.state_page = mmap.mmap(-1, 16 * 2 * len(channels))  # MAP_SHARED: seen by every worker

    def spawn(slot, kind):
        pid = os.fork()
        if pid == 0:
            for other, pairs in enumerate(channels):
                for other_kind, (job_fd, result_fd) in pairs.items():
                    if (other, other_kind) != (slot, kind):
                        os.close(job_fd)
                        os.close(result_fd)
            os.close(status_fd)
            os.close(own_status)
            worker_loop(slot, kind, channels[slot][kind][0], channels[slot][kind][1], zygote)
            os._exit(0)
        return pid

    def worker_died(slot, kind, status):
        """Answer the call the dead worker was running (if any) and give its slot a new worker; if
        it died half-way through a message, stop: the service starts a new zygote."""
        phase, job_id = WorkerState(zygote.runtime.state_page, slot, kind).get()
        if phase in (READING, WRITING):
            os._exit(1)
        if phase == RUNNING:
            how = (f"killed by {_signal_name(os.WTERMSIG(status))}" if os.WIFSIGNALED(status)
                   else f"exit status {os.WEXITSTATUS(status)}")
            write_msg(channels[slot][kind][1], {
                "id": job_id, "status": "worker_died", "exit_code": None, "duration_s": 0.0, "truncated": False,
                "stdout": 0, "stderr": 0,
                "notes": [f"WorkerDied: the sandbox process running this code died ({how}; e.g. the kernel's "
                          "OOM killer); the call was not completed"]})
        workers[spawn(slot, kind)] = (slot, kind)

    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        own_status = os.open("/proc/self/status", os.O_RDONLY)  # still readable after pivot_root
        zygote.runtime.proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # for each forker's own maps
        for name in zygote.settings.light_preload:
            __import__(name)
        facts["seccomp"] = zygote.settings.seccomp is not None
        tree = zygote.settings.cgroups
        if tree:
            zygote.runtime.cgroup_version = tree["version"]
            zygote.runtime.cgroup_slot_fds = [cgroups.open_dirs(s) for s in tree["slots"]]
            zygote.runtime.cgroup_sessions_fds = cgroups.open_dirs(tree["sessions"])
        if zygote.settings.strict:
            isolate_master(zygote)
        else:
            os.makedirs(zygote.settings.work_root, mode=0o700, exist_ok=True)
        facts["minimal_root"] = zygote.settings.strict
        zygote.runtime.closer_fd = start_closer() if zygote.settings.strict else None
        for kind in channels[0]:  # "light" first, then (if any) "heavy"
            if kind == "heavy":
                for name in zygote.settings.heavy_preload:
                    __import__(name)
                if zygote.settings.warmup:
                    # First calls into sympy import submodules lazily and fill caches: pay that once here.
                    exec(compile(zygote.settings.warmup, "<warmup>", "exec"), {"__name__": "__warmup__"})
            # RLIMIT_AS (without a cgroup) counts the worker's own mappings: the limit is on top
            zygote.runtime.address_space_base = _vm_size(own_status)
            for slot in range(len(channels)):
                workers[spawn(slot, kind)] = (slot, kind)
    except BaseException as e:  # noqa: BLE001
        write_msg(status_fd, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    write_msg(status_fd, {"ready": True, "pid": os.getpid(), **facts})
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        slot_kind = workers.pop(pid, None)
        if slot_kind is None:
            continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            if not workers:
                os._exit(0)
            continue  # its job pipe closed: the service is shutting down
        worker_died(*slot_kind, status)  # it never runs user code: killed from outside (OOM killer, kill)


if __name__ == "__main__":
    main()
