"""The zygote's state (zygote/main.py): what the service decided (Settings), what each process found
or opened (Runtime), and the constants every part of the zygote shares: the calls' file
descriptors and the processes' names. Standard library only, imported as a top-level sibling
(no package inside the zygote)."""

USER_FILE = "<code>"
EOF_GRACE_S = 2.0  # after the call exits, how long to wait for its pipes to close
SETUP_FD = 3       # inside the call: written once ("R") when confinement is complete, then closed
CELL_FD = 4        # inside a session: cells to run
DONE_FD = 5        # inside a session: one byte per finished cell
OOM_SCORE_ADJ = 1000  # the sandbox's processes are the kernel OOM killer's first choice
HOST_NAME = "sandbox"  # what a call sees as the host's name (its UTS namespace, strict isolation)

# /proc/<pid>/comm of the zygote's processes (the service and the tests tell them apart by it)
FORKER_NAME = "sandbox-forker"  # a worker's forker
CALL_NAME = "sandbox-call"      # a call (a worker's other children)
SESSION_NAME = "sandbox-session"
CLOSER_NAME = "sandbox-closer"  # the zygote's one child that is not a worker


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
        self.cgroups = raw.get("cgroups")  # sandbox.zygote.cgroups tree (paths), or None


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

