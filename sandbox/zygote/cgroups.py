"""Per-call cgroups: every process of one call shares one memory, pids and CPU budget.

rlimits are per process: a call that forks 32 children gets 32x the memory and CPU seconds, and
memfd / SysV shm pages escape RLIMIT_AS altogether. A cgroup counts all of it (shmem included).

Layout: one cgroup per worker slot, `<own cgroup>/rstar2-sandbox-<id>/slot<i>`, reused by the
slot's calls one after another (a call's processes are all dead before the next one starts, so
the cgroup holds exactly one call at a time; its OOM counter is read before and after). The
slot's forker (forker.forker_loop) lives there too, asleep while a call runs, so that each call
is born in the cgroup instead of moving into it (a move waits for an RCU grace period after
any pause: ~7 ms); its pids limit has one more for it. An OOM in the slot may end the forker
(v2 kills the whole cgroup; v1 the largest process, normally the call): its worker starts a new
one for the next call. Sessions
each get their own, `.../sessions/session-<uid>`, with a call's limits; `sessions` itself caps
the memory of all of them together (idle ones included): past it the kernel's OOM killer ends
one of them (its next cell says so), never a call or the service.

cgroup v1 (separate memory, pids and cpu hierarchies, as on this project's CI machines) and v2
(unified; needs the controllers delegated to the service's cgroup) are both handled.

Standard library only: the service creates and removes the tree (sandbox.pool), the zygote joins
and reads it through directory fds (it imports this file as a top-level module).
"""

import os
import time

V1_CONTROLLERS = ("memory", "pids", "cpu")
PREFIX = "rstar2-sandbox-"
CPU_PERIOD_US = 100_000


def _mountinfo():
    """[(mount point, root within the hierarchy, fstype, super options)] of cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.rstrip("\n").split(" - ", 1)
            fields, rfields = left.split(), right.split()
            if rfields[0] in ("cgroup", "cgroup2"):
                found.append((fields[4], fields[3], rfields[0], set(rfields[2].split(","))))
    return found


def _own_paths():
    """{controller or "": path} of this process, from /proc/self/cgroup ("" is the v2 hierarchy)."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _join(mount_point, mount_root, own):
    rel = own[len(mount_root):] if own.startswith(mount_root) else own
    return os.path.join(mount_point, rel.lstrip("/"))


def find_parents():
    """("v1" | "v2", {controller: directory of our own cgroup}) or (None, why not)."""
    mounts, own = _mountinfo(), _own_paths()
    v1 = {}
    for c in V1_CONTROLLERS:
        for point, root, fstype, opts in mounts:
            if fstype == "cgroup" and c in opts and c in own:
                v1[c] = _join(point, root, own[c])
                break
    if len(v1) == len(V1_CONTROLLERS):
        return "v1", v1
    for point, root, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            parent = _join(point, root, own[""])
            try:
                with open(os.path.join(parent, "cgroup.controllers")) as f:
                    available = set(f.read().split())
            except OSError:
                continue
            missing = {"memory", "pids", "cpu"} - available
            if not missing:
                return "v2", {"": parent}
    return None, "no writable cgroup hierarchy with the memory, pids and cpu controllers"


def limit_writes(version, memory_bytes, processes, cpus):
    """[(controller, file, value)] that set one call's limits, in order (files a kernel lacks,
    e.g. swap accounting, are skipped by the writer)."""
    quota = max(1000, int(cpus * CPU_PERIOD_US))
    if version == "v1":
        return [("memory", "memory.limit_in_bytes", memory_bytes),
                ("memory", "memory.memsw.limit_in_bytes", memory_bytes),  # no escape to swap
                ("pids", "pids.max", processes),
                ("cpu", "cpu.cfs_period_us", CPU_PERIOD_US),
                ("cpu", "cpu.cfs_quota_us", quota)]
    return [("", "memory.max", memory_bytes),
            ("", "memory.swap.max", 0),
            ("", "memory.oom.group", 1),  # an OOM kills the whole call, not one of its processes
            ("", "pids.max", processes),
            ("", "cpu.max", f"{quota} {CPU_PERIOD_US}")]


def sessions_limit_writes(version, memory_bytes):
    """[(controller, file, value)] for the parent of all sessions: their memory together; in v2 it
    also passes the controllers on to each session's own cgroup."""
    if version == "v1":
        return [("memory", "memory.limit_in_bytes", memory_bytes),
                ("memory", "memory.memsw.limit_in_bytes", memory_bytes)]
    return [("", "memory.max", memory_bytes), ("", "memory.swap.max", 0),
            ("", "cgroup.subtree_control", "+memory +pids +cpu")]


def _write(directory, name, value):
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def _apply(dirs, writes):
    """Write each (controller, file, value) into dirs[controller], skipping files this kernel lacks."""
    for controller, name, value in writes:
        if os.path.exists(os.path.join(dirs[controller], name)):
            _write(dirs[controller], name, value)


class CgroupTree:
    """The sandbox's cgroups: created by the service before the zygote starts, removed after."""

    def __init__(self, version, tops, slots, sessions=None):
        self.version = version
        self.tops = tops          # {controller: <parent>/rstar2-sandbox-<id>}
        self.slots = slots        # [{controller: slot dir}, ...]
        self.sessions = sessions  # {controller: <top>/sessions}: the parent of every session's cgroup

    @classmethod
    def create(cls, n_slots, *, memory_bytes, processes, cpus, sessions_memory_bytes, name=None):
        """The tree, or (None, reason) where cgroups cannot be used here (no error: a fallback)."""
        version, parents = find_parents()
        if version is None:
            return None, parents
        for parent in parents.values():
            _remove_stale(parent)
        name = name or f"{PREFIX}{os.getpid()}-{time.monotonic_ns()}"
        tops = {c: os.path.join(p, name) for c, p in parents.items()}
        tree = cls(version, tops, [])
        try:
            for top in tops.values():
                os.mkdir(top, 0o755)
            if version == "v2":
                # A v2 cgroup passes controllers to its children only if enabled in its
                # subtree_control; ours has no processes of its own, so this is allowed.
                _write(tops[""], "cgroup.subtree_control", "+memory +pids +cpu")
            for i in range(n_slots):
                slot = {c: os.path.join(top, f"slot{i}") for c, top in tops.items()}
                for d in slot.values():
                    os.mkdir(d, 0o755)
                tree.slots.append(slot)
                # + 1: the slot's forker lives in its cgroup too (every call is born there)
                _apply(slot, limit_writes(version, memory_bytes, processes + 1, cpus))
            tree.sessions = {c: os.path.join(top, "sessions") for c, top in tops.items()}
            for d in tree.sessions.values():
                os.mkdir(d, 0o755)
            _apply(tree.sessions, sessions_limit_writes(version, sessions_memory_bytes))
        except OSError as e:
            tree.remove()
            return None, f"cannot set up cgroups under {', '.join(parents.values())}: {e.strerror or e}"
        return tree, ""

    def to_dict(self):
        return {"version": self.version, "slots": self.slots, "tops": self.tops, "sessions": self.sessions}

    def sessions_peak_bytes(self):
        """The most memory all sessions together have held (None where the kernel does not say)."""
        directory, name = ((self.sessions["memory"], "memory.max_usage_in_bytes") if self.version == "v1"
                           else (self.sessions[""], "memory.peak"))
        try:
            with open(os.path.join(directory, name)) as f:
                return int(f.read())
        except OSError:
            return None

    def remove(self, timeout_s=5.0):
        """rmdir every slot, the sessions' parent and the top (empty once the zygote and its calls are gone)."""
        deadline = time.monotonic() + timeout_s
        dirs = [d for slot in self.slots for d in slot.values()] + list((self.sessions or {}).values())
        for d in dirs + list(self.tops.values()):
            _rmdir_when_empty(d, None, deadline)


def _rmdir_when_empty(path, dir_fd, deadline):
    """rmdir a cgroup, retrying while it is busy (its processes still exiting) until `deadline`."""
    while True:
        try:
            os.rmdir(path, dir_fd=dir_fd)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _remove_stale(parent):
    """Trees left by services that were killed (their pid is gone): remove the empty ones."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            top = os.path.join(parent, name)
            try:
                for slot in os.listdir(top):  # slot<i>, and sessions (with its session-<uid>s)
                    path = os.path.join(top, slot)
                    if os.path.isdir(path):
                        for child in os.listdir(path):
                            if os.path.isdir(os.path.join(path, child)):
                                os.rmdir(os.path.join(path, child))
                        os.rmdir(path)
                os.rmdir(top)
            except OSError:
                pass


# ------------------------------------------------------------------------------------------------
# used inside the zygote, through directory fds opened before it leaves the host's file system

def open_dirs(dirs):
    """{controller: O_DIRECTORY fd} of {controller: cgroup directory} (a slot's, or the tops)."""
    return {c: os.open(d, os.O_RDONLY | os.O_DIRECTORY) for c, d in dirs.items()}


def make_child(version, top_fds, name, limits):
    """A cgroup `name` under each top (a session's own), with a call's limits; its dir fds."""
    fds = {}
    for c, top in top_fds.items():
        os.mkdir(name, 0o755, dir_fd=top)
        fds[c] = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
    for controller, file, value in limit_writes(version, limits["memory_bytes"], limits["processes"], limits["cpus"]):
        try:
            fd = os.open(file, os.O_WRONLY, dir_fd=fds[controller])
        except FileNotFoundError:
            continue
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
    return fds


def remove_child(top_fds, name, child_fds, timeout_s=2.0):
    for fd in child_fds.values():
        os.close(fd)
    deadline = time.monotonic() + timeout_s
    for top in top_fds.values():
        _rmdir_when_empty(name, top, deadline)


def join(dir_fds):
    """Move the calling process (and so its future children) into the slot's cgroups."""
    for fd in dir_fds.values():
        procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=fd)
        try:
            os.write(procs, b"0")  # "0": the writing process itself (it is PID 1 of its own namespace)
        finally:
            os.close(procs)


def _read(dir_fd, name):
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def parse_counter(text, key):
    """The value of `key` in a flat-keyed cgroup file ("key value" per line); 0 when absent."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def oom_kills(version, dir_fds):
    """How many processes the kernel has OOM-killed in this cgroup so far (a monotonic counter)."""
    if version == "v1":
        return parse_counter(_read(dir_fds["memory"], "memory.oom_control"), "oom_kill")
    return parse_counter(_read(dir_fds[""], "memory.events"), "oom_kill")


def shmem_bytes(version, dir_fds):
    """Shared memory charged to this cgroup: tmpfs files (a call's /tmp and /dev/shm), SysV
    segments and memfds. Unlike page cache the kernel cannot reclaim it (no swap), so a call's
    leftover counts against the next call's limit until its tmpfs is unmounted (zygote_supervise)."""
    if version == "v1":
        return parse_counter(_read(dir_fds["memory"], "memory.stat"), "shmem")
    return parse_counter(_read(dir_fds[""], "memory.stat"), "shmem")
