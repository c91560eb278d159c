"""The zygote: a warm Python process that forks one isolated process per code execution.

Standard library (plus pyseccomp), run as a script (`python -I zygote.py ...`) with an empty
environment by `sandbox.pool.ZygotePool`; it imports nothing of the rest of the package, so
nothing of the service is inside the processes that run untrusted code.

Process tree (strict isolation):

    service (asyncio)  --pipes-->  master zygote  (imports numpy, sympy, ...; then its own mount,
                                    |               network and IPC namespaces, pivot_root into a
                                    |               minimal read-only root: /usr, the interpreter,
                                    |               /dev/{null,zero,full,random,urandom}; nothing else)
                                    +-- worker i   (one per slot, own network namespace; reads a job,
                                          |          supervises one call at a time)
                                          +-- call (clone(NEWPID|NEWIPC|NEWNS): PID 1 of a fresh PID
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

Wire format on every pipe: 4-byte big-endian length + UTF-8 JSON. Messages to a worker: a job
{"id", "code", "stdin", "timeout"}, or {"cancel": id} (stop that job if it is still running).
"""

import ast
import builtins
import io
import json
import linecache
import os
import resource
import select
import signal
import struct
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves out the script's dir
import cgroups  # noqa: E402 - siblings, imported as top-level modules (no package inside the zygote)
import confine  # noqa: E402
sys.path.pop(0)
from confine import CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG

USER_FILE = "<code>"
EOF_GRACE_S = 2.0  # after the call exits, how long to wait for its pipes to close
SETUP_FD = 3       # inside the call: written once ("R") when confinement is complete, then closed
OOM_SCORE_ADJ = 1000  # the sandbox's processes are the kernel OOM killer's first choice


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


def _enter_call(job, cfg, slot, stdin_fd, out_w, err_w, setup_w):
    """In the cloned child, as root: confine, drop privileges, run the code. Never returns.

    Any failure before user code starts exits without having written to the setup pipe: the
    supervisor reports it as "internal". Once the pipe is closed, nothing the code does can.
    """
    try:
        confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        strict = cfg["isolation"] == "strict"
        uid = cfg["uid_base"] + slot
        if cfg["cgroup_fds"]:
            cgroups.join(cfg["cgroup_fds"])
        if strict:
            confine.mount_call_filesystems(uid, cfg["limits"]["tmpfs_bytes"])
            workdir = "/tmp"
        else:
            workdir = cfg["workdir"]
        os.setsid()  # own session and process group: kill(0, ...) reaches only this call
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(setup_w, SETUP_FD)
        os.closerange(SETUP_FD + 1, 1 << 16)
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
        if not cfg["cgroup_fds"]:  # without a cgroup: per-process limits are all there is
            address_space = cfg["address_space_base"] + limits["memory_bytes"]
            rl.append((resource.RLIMIT_AS, (address_space, address_space)))
            if strict:
                rl.append((resource.RLIMIT_NPROC, (limits["processes"],) * 2))
        for which, value in rl:
            resource.setrlimit(which, value)
        if strict:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        confine.prctl(PR_SET_NO_NEW_PRIVS, 1)
        if cfg["seccomp"] is not None:
            confine.load_seccomp(cfg["seccomp"])
        os.environ.clear()
        code = job["code"]
        cfg = job = None  # the supervisor's data is not the code's business
        os.write(SETUP_FD, b"R")
        os.close(SETUP_FD)
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        finally:
            os._exit(1)
    os._exit(run_user_code(code))


# ------------------------------------------------------------------------------------------------
# worker: one call at a time

def _signal_name(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def execute(job, cfg, slot, counter, job_fd):
    """Run one job; every fd and directory it makes is released whatever happens."""
    fds = []
    workdir = None
    try:
        if cfg["isolation"] != "strict":
            workdir = cfg["workdir"] = os.path.join(cfg["work_root"], f"w{slot}-{counter}")
            os.mkdir(workdir, 0o700)
        stdin_fd = os.memfd_create("stdin", 0)
        fds.append(stdin_fd)
        # surrogatepass: a lone surrogate (valid JSON, invalid UTF-8) must not fail the worker
        os.write(stdin_fd, job["stdin"].encode("utf-8", "surrogatepass"))
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        setup_r, setup_w = os.pipe()
        fds += [out_r, out_w, err_r, err_w, setup_r, setup_w]
        return _supervise(job, cfg, slot, job_fd, stdin_fd, (out_r, out_w), (err_r, err_w), (setup_r, setup_w), fds)
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if workdir is not None:
            remove_tree(workdir)


def _supervise(job, cfg, slot, job_fd, stdin_fd, out, err, setup, fds):
    limits = cfg["limits"]
    started = time.monotonic()
    oom_before = cgroups.oom_kills(cfg["cgroup_version"], cfg["cgroup_fds"]) if cfg["cgroup_fds"] else 0
    flags = CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS if cfg["isolation"] == "strict" else 0
    pid = confine.clone(flags)
    if pid == 0:
        _enter_call(job, cfg, slot, stdin_fd, out[1], err[1], setup[1])
    for fd in (stdin_fd, out[1], err[1], setup[1]):
        os.close(fd)
        fds.remove(fd)
    out_r, err_r = out[0], err[0]
    caps = {out_r: limits["stdout_bytes"], err_r: limits["stderr_bytes"]}
    buffers = {out_r: bytearray(), err_r: bytearray()}
    open_fds = {out_r, err_r}
    pidfd = os.pidfd_open(pid)
    fds.append(pidfd)
    deadline = started + float(job["timeout"])
    reason = None  # why we killed it: "timeout" | "output_limit" | "cancelled"
    wait_status = rusage = None
    eof_deadline = None
    watch_jobs = True
    while True:
        now = time.monotonic()
        if wait_status is None:
            if reason is None and now >= deadline:
                reason = "timeout"
                _kill_call(pid, cfg)
            watch = [pidfd, *open_fds] + ([job_fd] if watch_jobs else [])
            wait_s = max(0.0, deadline - now) if reason is None else 0.1
        else:
            # The call is gone (and with it its PID namespace); collect what is left in the pipes.
            if not open_fds or now >= eof_deadline:
                break
            watch, wait_s = list(open_fds), eof_deadline - now
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
                        _kill_call(pid, cfg)
                    watch_jobs = msg is not None
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
    duration = time.monotonic() - started
    setup_done = os.read(setup[0], 1) == b"R"
    oom = cgroups.oom_kills(cfg["cgroup_version"], cfg["cgroup_fds"]) - oom_before if cfg["cgroup_fds"] else 0
    cpu_s = rusage.ru_utime + rusage.ru_stime
    return _result(wait_status, reason, job, buffers[out_r], buffers[err_r], caps[out_r], caps[err_r],
                   duration, setup_done=setup_done, oom_kills=oom, cpu_s=cpu_s)


def _result(wait_status, reason, job, out, err, out_cap, err_cap, duration, *, setup_done, oom_kills, cpu_s):
    truncated = len(out) > out_cap or len(err) > err_cap
    stdout = bytes(out[:out_cap]).decode("utf-8", "replace")
    stderr = bytes(err[:err_cap]).decode("utf-8", "replace")
    notes = []
    if not setup_done and reason is None:
        return {"status": "internal", "stdout": "", "stderr": "sandbox internal error: " + stderr,
                "exit_code": None, "duration_s": duration, "truncated": False}
    if os.WIFEXITED(wait_status):
        exit_code = os.WEXITSTATUS(wait_status)
        status = "ok" if exit_code == 0 else "error"
    else:
        sig = os.WTERMSIG(wait_status)
        exit_code = -sig
        cpu_limit = int(job["timeout"]) + 1
        if sig == signal.SIGXCPU and cpu_s >= cpu_limit - 0.05:  # the kernel's CPU limit, not a self-kill
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


def worker_loop(slot, job_fd, result_fd, cfg):
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if cfg["isolation"] == "strict":
        confine.unshare(CLONE_NEWNET)  # abstract unix sockets are per network namespace: one per slot
    slot_fds = cfg["cgroup_slot_fds"][slot] if cfg["cgroup_slot_fds"] else None
    for i, fds in enumerate(cfg["cgroup_slot_fds"] or []):
        if i != slot:
            for fd in fds.values():
                os.close(fd)
    cfg["cgroup_fds"] = slot_fds
    counter = 0
    while True:
        job = read_msg(job_fd)
        if job is None:
            os._exit(0)
        if "cancel" in job:
            continue  # for a job that already finished
        counter += 1
        _serve_one(job, cfg, slot, counter, job_fd, result_fd)
        job = None  # the next call is forked from this frame: it must not find this job here


def _serve_one(job, cfg, slot, counter, job_fd, result_fd):
    """Run one job and send its result. The result lives only in this frame, which is gone before
    the next call is forked (its stack frames would otherwise hand it the previous output)."""
    try:
        result = execute(job, cfg, slot, counter, job_fd)
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

def interpreter_dirs():
    """The interpreter's own directories (prefixes hold the stdlib and site-packages); never the
    script's directory or other sys.path entries (an editable install points into the repo)."""
    dirs = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                  sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable)))
                   if p and os.path.isdir(p)})
    kept = []
    for d in dirs:
        if not any(d.startswith(k + "/") for k in kept):
            kept.append(d)
    return kept


def isolate_master(cfg):
    """Namespaces and the minimal root shared by all calls of this zygote (made once)."""
    confine.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC)
    confine.mount(None, "/", None, confine.MS_REC | confine.MS_PRIVATE)
    root = "/tmp"  # a fresh tmpfs over the host's /tmp (in this mount namespace only)
    confine.mount("tmpfs", root, "tmpfs", confine.MS_NOSUID | confine.MS_NODEV, "size=1m,mode=0755")
    confine.build_minimal_root(root, interpreter_dirs())
    confine.enter_root(root)


def main():
    cfg = json.loads(sys.argv[1])
    channels = cfg["channels"]  # [[job_fd, result_fd], ...] inherited from the service
    status_fd = cfg["status_fd"]
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    facts = {}
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        for name in cfg["preload"]:
            __import__(name)
        if cfg.get("warmup"):
            # First calls into sympy import submodules lazily and fill caches: pay that once here.
            exec(compile(cfg["warmup"], "<warmup>", "exec"), {"__name__": "__warmup__"})
        program = confine.seccomp_program()
        cfg["seccomp"] = program
        facts["seccomp"] = program is not None
        tree = cfg.get("cgroups")
        cfg["cgroup_version"] = tree["version"] if tree else None
        cfg["cgroup_slot_fds"] = [cgroups.open_slot(s) for s in tree["slots"]] if tree else None
        cfg["address_space_base"] = _vm_size()  # RLIMIT_AS (no cgroup) counts the zygote's own mappings
        if cfg["isolation"] == "strict":
            isolate_master(cfg)
            facts["minimal_root"] = True
        else:
            os.makedirs(cfg["work_root"], mode=0o700, exist_ok=True)
            facts["minimal_root"] = False
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
    write_msg(status_fd, {"ready": True, "pid": os.getpid(), **facts})
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
