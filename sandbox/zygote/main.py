"""The zygote: a warm Python process that forks one isolated process per code execution.

Standard library (plus pyseccomp), run as a script (`python -I zygote/main.py ...`) with an empty
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

The zygote's parts, one job each (the package sandbox/zygote/, imported by start.py as the
top-level package `zygote`: nothing of the service is importable from a call, and nothing of it
loads into the zygote): zygote/state.py (settings, runtime, shared constants), zygote/splice.py (bytes kernel to
kernel), zygote/usercode.py (running the code, capturing and reporting), zygote/child.py (a
cloned call's or session's confinement), zygote/forker.py (cloning calls), zygote/supervise.py
(one call, from its job to its result), zygote/sessions.py (live interpreters),
zygote/closer.py (mount namespaces freed off the call's path), zygote/worker.py (a slot's job
loop) and this file, the master.
"""

import json
import mmap
import os
import signal
import sys

from . import cgroups
from . import confine
from . import wire
from .confine import CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWUTS, PR_SET_PDEATHSIG
from .closer import start_closer
from .state import HOST_NAME, OOM_SCORE_ADJ, Runtime, Settings, Zygote
from .supervise import signal_name
from .worker import READING, RUNNING, WRITING, WorkerState, worker_loop


def read_settings():
    """The service's settings, from stdin (never argv: every call would see them in its
    /proc/self/cmdline), which then becomes /dev/null."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return b"".join(chunks).decode()


def vm_size(status_fd):
    os.lseek(status_fd, 0, os.SEEK_SET)
    for line in os.read(status_fd, 1 << 16).decode().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


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
    # its own host name too (UTS): a call sees "sandbox", not the host's
    confine.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
    confine.sethostname(HOST_NAME)
    confine.mount(None, "/", None, confine.MS_REC | confine.MS_PRIVATE)
    needed = interpreter_dirs()
    zygote.runtime.rebind = confine.covered_by_call_mounts(needed)
    root = confine.root_mount_point(needed)
    # a fresh tmpfs over an existing directory (in this mount namespace only)
    confine.mount("tmpfs", root, "tmpfs", confine.MS_NOSUID | confine.MS_NODEV, "size=1m,mode=0755")
    confine.build_minimal_root(root, needed)
    confine.enter_root(root)


def main():
    """Start-up order matters: namespaces and the minimal root first, then light workers (forked
    while only the light modules are imported), then numpy/sympy (imported from inside the
    minimal root), then heavy workers. A call is forked from a light or heavy worker of its slot
    (the service routes by the modules the code names): forking a process with sympy and numpy
    loaded costs ~2.4 ms of page-table copying, one with the standard library ~0.5 ms."""
    zygote = Zygote(Settings(json.loads(read_settings())), Runtime())
    confine.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    master = Master(zygote)
    try:
        facts = master.start()
    except BaseException as e:  # noqa: BLE001
        wire.write_msg(master.status_fd, {"ready": False, "error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    wire.write_msg(master.status_fd, {"ready": True, "pid": os.getpid(), **facts})
    master.serve()


class Master:
    """The zygote's master process: starts every slot's workers, then replaces those that die."""

    def __init__(self, zygote: Zygote):
        self.zygote = zygote
        self.channels = zygote.settings.channels  # [{kind: [job_fd, result_fd]}] per slot, inherited from the service
        self.status_fd = zygote.settings.status_fd
        self.workers: dict[int, tuple[int, str]] = {}  # pid -> (slot, kind)
        self.own_status: int | None = None
        zygote.runtime.state_page = mmap.mmap(-1, 16 * 2 * len(self.channels))  # MAP_SHARED: seen by every worker

    def start(self) -> dict:
        """The namespaces, the minimal root, the closer and every slot's workers; what it enforces."""
        zygote, facts = self.zygote, {}
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        self.own_status = os.open("/proc/self/status", os.O_RDONLY)  # still readable after pivot_root
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
        for kind in self.channels[0]:  # "light" first, then (if any) "heavy"
            if kind == "heavy":
                for name in zygote.settings.heavy_preload:
                    __import__(name)
                if zygote.settings.warmup:
                    # First calls into sympy import submodules lazily and fill caches: pay that once here.
                    exec(compile(zygote.settings.warmup, "<warmup>", "exec"), {"__name__": "__warmup__"})
            # RLIMIT_AS (without a cgroup) counts the worker's own mappings: the limit is on top
            zygote.runtime.address_space_base = vm_size(self.own_status)
            for slot in range(len(self.channels)):
                self.workers[self.spawn(slot, kind)] = (slot, kind)
        return facts

    def spawn(self, slot: int, kind: str) -> int:
        pid = os.fork()
        if pid == 0:
            for other, pairs in enumerate(self.channels):
                for other_kind, (job_fd, result_fd) in pairs.items():
                    if (other, other_kind) != (slot, kind):
                        os.close(job_fd)
                        os.close(result_fd)
            os.close(self.status_fd)
            os.close(self.own_status)
            job_fd, result_fd = self.channels[slot][kind]
            worker_loop(slot, kind, job_fd, result_fd, self.zygote)
            os._exit(0)
        return pid

    def worker_died(self, slot: int, kind: str, status: int):
        """Answer the call the dead worker was running (if any) and give its slot a new worker; if
        it died half-way through a message, stop: the service starts a new zygote."""
        phase, job_id = WorkerState(self.zygote.runtime.state_page, slot, kind).get()
        if phase in (READING, WRITING):
            os._exit(1)
        if phase == RUNNING:
            how = (f"killed by {signal_name(os.WTERMSIG(status))}" if os.WIFSIGNALED(status)
                   else f"exit status {os.WEXITSTATUS(status)}")
            wire.write_msg(self.channels[slot][kind][1], {
                "id": job_id, "status": "worker_died", "exit_code": None, "duration_s": 0.0, "truncated": False,
                "stdout": 0, "stderr": 0,
                "notes": [f"WorkerDied: the sandbox process running this code died ({how}; e.g. the kernel's "
                          "OOM killer); the call was not completed"]})
        self.workers[self.spawn(slot, kind)] = (slot, kind)

    def serve(self):
        """Until every worker has exited cleanly (the service closed their pipes): replace the dead."""
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                os._exit(0)
            slot_kind = self.workers.pop(pid, None)
            if slot_kind is None:
                continue
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                if not self.workers:
                    os._exit(0)
                continue  # its job pipe closed: the service is shutting down
            self.worker_died(*slot_kind, status)  # it never runs user code: killed from outside (OOM killer, kill)


if __name__ == "__main__":
    main()
