"""The zygote: a warm Python process that forks one isolated process per code execution.

Standard library only, run as a script (`python -I zygote.py ...`) with an empty environment by
`sandbox.pool.ZygotePool`; it imports nothing of the rest of the package, so nothing of the
service is inside the processes that run untrusted code.

Process tree (strict isolation):

    service (asyncio)  --pipes-->  master zygote  (imports numpy, sympy, ...; own network, mount and
                                    |               IPC namespaces: no interfaces up, private /tmp,
                                    |               read-only /dev/shm and /var/tmp, /proc with hidepid)
                                    +-- worker i   (one per slot; reads a job, supervises one call at a time)
                                          +-- call (clone(CLONE_NEWPID): PID 1 of a fresh PID namespace,
                                                    uid `uid_base + i`, rlimits, empty env, private workdir)

Why this shape:
- Forking from the warm worker costs a few ms; a fresh interpreter with sympy costs 300+ ms.
- The call is PID 1 of its own PID namespace, so when it ends the kernel kills every process
  in that namespace, including setsid daemons and double forks; it cannot see or signal anything
  outside.
- One uid per worker slot: concurrent calls cannot read each other's files, and RLIMIT_NPROC
  caps each call's processes and threads separately.
- The result (status, exit code, timing) is decided here, from the kernel's exit status and the
  raw pipes; nothing the code prints can forge it.

Wire format on every pipe: 4-byte big-endian length + UTF-8 JSON.
"""

import ast
import builtins
import ctypes
import errno
import io
import json
import linecache
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 0x1000
MS_REC = 0x4000
MNT_DETACH = 2
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)

USER_FILE = "<code>"
EXIT_MEMORY = 251  # the call ran out of memory (MemoryError)
EXIT_SETUP = 252   # isolation setup inside the call failed (never user code)
EOF_GRACE_S = 2.0  # after the call exits, how long to wait for its pipes to close

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = ctypes.PyDLL(None).syscall  # PyDLL: keeps the GIL across clone, as os.fork does
_syscall.restype = ctypes.c_long


# ------------------------------------------------------------------------------------------------
# wire format

def read_msg(fd):
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (n,) = struct.unpack(">I", header)
    body = _read_exact(fd, n)
    if body is None:
        return None
    return json.loads(body)


def _read_exact(fd, n):
    chunks = []
    while n:
        try:
            chunk = os.read(fd, n)
        except InterruptedError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def write_msg(fd, obj):
    body = json.dumps(obj).encode()
    data = struct.pack(">I", len(body)) + body
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ------------------------------------------------------------------------------------------------
# kernel calls

def _check(ret, what):
    if ret < 0 or ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source, target, fstype, flags=0, data=None):
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"mount {target}")


def umount(target):
    _check(_libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH)), f"umount {target}")


def prctl(option, arg):
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl")


def clone(flags):
    """fork() that also takes CLONE_* flags (CLONE_NEWPID: the child is PID 1 of a new namespace).

    Python cannot unshare(CLONE_NEWPID) twice in one process, and a fork per call plus a fork
    inside it doubles the cost; the raw clone syscall with the interpreter's own before/after-fork
    hooks (what os.fork runs) gives one fork per call.
    """
    if SYS_CLONE is None:
        raise OSError(errno.ENOSYS, f"clone: unsupported machine {os.uname().machine}")
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _syscall(ctypes.c_long(SYS_CLONE), ctypes.c_ulong(flags | signal.SIGCHLD),
                   None, None, None, None)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


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


def run_user_code(code):
    """Run `code` as a script; repr of a last expression when nothing was printed. Returns exit code."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
    raw_stdout = _TrackingFileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(raw_stdout, 16384), encoding="utf-8",
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", write_through=True)
    sys.argv = [USER_FILE]
    linecache.cache[USER_FILE] = (len(code), None, code.splitlines(True), USER_FILE)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__file__": USER_FILE}
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
        if e.code is None or isinstance(e.code, int):
            exit_code = e.code or 0
        else:
            sys.stderr.write(f"{e.code}\n")
            exit_code = 1
    except MemoryError:
        sys.stderr.write("MemoryError: the code exceeded its memory limit\n")
        exit_code = EXIT_MEMORY
    except BaseException as e:  # noqa: BLE001 - the user's exception is the result
        te = _filter_user_frames(traceback.TracebackException.from_exception(e))
        sys.stderr.write("".join(te.format()))
        exit_code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - e.g. the output pipe was closed by the supervisor
            pass
    return exit_code


def _enter_call(job, cfg, slot, workdir, stdin_fd, out_w, err_w):
    """In the cloned child, as root: confine, drop privileges, run the code. Never returns."""
    code = EXIT_SETUP
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.setsid()  # own session and process group: kill(0, ...) reaches only this call
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        os.chdir(workdir)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        limits = cfg["limits"]
        cpu = int(job["timeout"]) + 1
        rl = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2),
            (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        address_space = cfg["address_space_base"] + limits["memory_bytes"]
        rl.append((resource.RLIMIT_AS, (address_space, address_space)))
        if cfg["isolation"] == "strict":
            rl.append((resource.RLIMIT_NPROC, (limits["processes"],) * 2))
        for which, value in rl:
            resource.setrlimit(which, value)
        if cfg["isolation"] == "strict":
            uid = cfg["uid_base"] + slot
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        os.environ.clear()
        code = run_user_code(job["code"])
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        except OSError:
            pass
    os._exit(code)


# ------------------------------------------------------------------------------------------------
# worker: one call at a time

def _signal_name(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def execute(job, cfg, slot, counter):
    limits = cfg["limits"]
    started = time.monotonic()
    workdir = os.path.join(cfg["work_root"], f"w{slot}-{counter}")
    os.mkdir(workdir, 0o700)
    if cfg["isolation"] == "strict":
        os.chown(workdir, cfg["uid_base"] + slot, cfg["uid_base"] + slot)
    stdin_fd = os.memfd_create("stdin", 0)
    os.write(stdin_fd, job.get("stdin", "").encode("utf-8", "surrogateescape"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    flags = CLONE_NEWPID if cfg["isolation"] == "strict" else 0
    pid = clone(flags)
    if pid == 0:
        _enter_call(job, cfg, slot, workdir, stdin_fd, out_w, err_w)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)

    caps = {out_r: limits["stdout_bytes"], err_r: limits["stderr_bytes"]}
    buffers = {out_r: bytearray(), err_r: bytearray()}
    open_fds = {out_r, err_r}
    pidfd = os.pidfd_open(pid)
    deadline = started + float(job["timeout"])
    reason = None  # why we killed it: "timeout" | "output_limit"
    wait_status = None
    eof_deadline = None
    while True:
        now = time.monotonic()
        if wait_status is None:
            if reason is None and now >= deadline:
                reason = "timeout"
                _kill_call(pid, cfg)
            watch = [pidfd, *open_fds]
            wait_s = max(0.0, deadline - now) if reason is None else 0.1
        else:
            # The call is gone (and with it its PID namespace); collect what is left in the pipes.
            if not open_fds or now >= eof_deadline:
                break
            watch, wait_s = list(open_fds), eof_deadline - now
        ready, _, _ = select.select(watch, [], [], wait_s)
        for fd in ready:
            if fd == pidfd:
                _, wait_status = os.waitpid(pid, 0)
                eof_deadline = time.monotonic() + EOF_GRACE_S
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            room = caps[fd] + 1 - len(buffers[fd])  # keep one byte past the cap: proof of overflow
            if room > 0:
                buffers[fd] += chunk[:room]
            if len(buffers[fd]) > caps[fd] and reason is None and wait_status is None:
                reason = "output_limit"
                _kill_call(pid, cfg)
    os.close(pidfd)
    for fd in (out_r, err_r):
        os.close(fd)
    duration = time.monotonic() - started
    shutil.rmtree(workdir, ignore_errors=True)
    return _result(wait_status, reason, job, buffers[out_r], buffers[err_r], caps[out_r], caps[err_r], duration)


def _result(wait_status, reason, job, out, err, out_cap, err_cap, duration):
    truncated = len(out) > out_cap or len(err) > err_cap
    stdout = bytes(out[:out_cap]).decode("utf-8", "replace")
    stderr = bytes(err[:err_cap]).decode("utf-8", "replace")
    notes = []
    if os.WIFEXITED(wait_status):
        exit_code = os.WEXITSTATUS(wait_status)
        status = {0: "ok", EXIT_MEMORY: "memory", EXIT_SETUP: "internal"}.get(exit_code, "error")
    else:
        sig = os.WTERMSIG(wait_status)
        exit_code = -sig
        if sig == signal.SIGXCPU:
            status = "timeout"
            notes.append("TimeoutError: CPU time limit exceeded")
        else:
            status = "killed"
            if reason is None:
                notes.append(f"killed by {_signal_name(sig)}")
    if reason == "timeout":
        status = "timeout"
        notes.append(f"TimeoutError: execution exceeded {job['timeout']} s")
    elif reason == "output_limit":
        status = "output_limit"
        notes.append("OutputLimitError: output exceeded the limit")
    for note in notes:
        stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + note + "\n"
    return {"status": status, "stdout": stdout, "stderr": stderr, "exit_code": exit_code,
            "duration_s": duration, "truncated": truncated}


def _kill_call(pid, cfg):
    try:
        os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: the kernel kills everything under it
    except ProcessLookupError:
        pass
    if cfg["isolation"] != "strict":
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def worker_loop(slot, job_fd, result_fd, cfg):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # RLIMIT_AS counts the address space inherited from the zygote (numpy, sympy, ...): the
    # memory limit is on top of that.
    cfg["address_space_base"] = _vm_size()
    counter = 0
    while True:
        job = read_msg(job_fd)
        if job is None:
            os._exit(0)
        counter += 1
        try:
            result = execute(job, cfg, slot, counter)
        except Exception as e:  # noqa: BLE001 - a broken call must not take the worker down
            result = {"status": "internal", "stdout": "", "stderr": f"sandbox internal error: {e!r}",
                      "exit_code": None, "duration_s": 0.0, "truncated": False}
        result["id"] = job.get("id")
        write_msg(result_fd, result)


def _vm_size():
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# ------------------------------------------------------------------------------------------------
# master

def isolate_master(cfg):
    """Namespaces shared by all calls of this zygote (created once; per call only a PID namespace)."""
    unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # /tmp: a private tmpfs holding the per-call work dirs; only root can create entries in it.
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['tmpfs_bytes']},nr_inodes=65536,mode=0711")
    # Other world-writable places: empty and read-only.
    for path in ("/dev/shm", "/var/tmp", "/run/lock", "/dev/mqueue"):
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0755")
    expose_paths(cfg["expose"])
    # A /proc that shows each uid only its own processes: the service, other calls and PID 1's
    # environment are invisible.
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")


def _blocked_ancestor(path):
    """The topmost ancestor of `path` that other users cannot traverse (e.g. /root, mode 0700)."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def expose_paths(paths):
    """Make the interpreter's own directories readable by the call's uid.

    Python often lives under a directory other users cannot enter (pyenv under /root, mode
    0700): imports of modules that were not preloaded would then fail. In the zygote's private
    mount namespace, such an ancestor is covered by an empty tmpfs (hiding everything else in it,
    e.g. root's secrets) and only the needed directories are bound back at their own paths.
    """
    needed = []
    for p in sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)}):
        if not any(p.startswith(q + "/") for q in needed):
            needed.append(p)
    plan = [(p, _blocked_ancestor(p)) for p in needed]
    plan = [(p, a) for p, a in plan if a is not None]
    if not plan:
        return
    staging = "/tmp/.expose"
    os.mkdir(staging, 0o700)
    staged = []
    for i, (p, _) in enumerate(plan):
        os.mkdir(f"{staging}/{i}")
        mount(p, f"{staging}/{i}", None, MS_BIND | MS_REC)
        staged.append((p, f"{staging}/{i}"))
    for ancestor in sorted({a for _, a in plan}):
        mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0711")
    for p, s in staged:
        os.makedirs(p, 0o755, exist_ok=True)
        mount(s, p, None, MS_BIND | MS_REC)
        umount(s)
    shutil.rmtree(staging)


def main():
    cfg = json.loads(sys.argv[1])
    channels = cfg["channels"]  # [[job_fd, result_fd], ...] inherited from the service
    status_fd = cfg["status_fd"]
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    try:
        for name in cfg["preload"]:
            __import__(name)
        if cfg.get("warmup"):
            # First calls into sympy import submodules lazily and fill caches: pay that once here.
            exec(compile(cfg["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
        cfg["expose"] = [p for p in sys.path if p] + [sys.prefix, sys.base_prefix, sys.exec_prefix]
        if cfg["isolation"] == "strict":
            isolate_master(cfg)
        os.makedirs(cfg["work_root"], mode=0o711, exist_ok=True)
    except BaseException as e:  # noqa: BLE001
        write_msg(status_fd, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        os._exit(1)

    def spawn(slot):
        pid = os.fork()
        if pid == 0:
            for other, (job_fd, result_fd) in enumerate(channels):
                if other != slot:
                    os.close(job_fd)
                    os.close(result_fd)
            os.close(status_fd)
            worker_loop(slot, channels[slot][0], channels[slot][1], cfg)
            os._exit(0)
        return pid

    workers = {spawn(slot): slot for slot in range(len(channels))}
    write_msg(status_fd, {"ready": True, "pid": os.getpid()})
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        slot = workers.pop(pid, None)
        if slot is None:
            continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            if not workers:
                os._exit(0)
            continue  # its job pipe closed: the service is shutting down
        workers[spawn(slot)] = slot  # a worker died (it never runs user code): replace it


if __name__ == "__main__":
    main()
