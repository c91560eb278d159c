"""A LocalSandbox driven from synchronous tests (its event loop runs in a background thread),
and checks that nothing of a call outlives it."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import sandbox
from sandbox.zygote import state as zygote_state
from sandbox.pool import process_name
from sandbox.zygote.main import interpreter_dirs  # the directories the sandbox binds, links included


class SyncSandbox:
    def __init__(self, **kwargs):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sb = sandbox.LocalSandbox(**kwargs)
        self.call(self.sb.start())

    def call(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, code, stdin="", timeout=5.0):
        return self.call(self.sb.run(code, stdin, timeout))

    def run_many(self, requests):
        return self.call(self.sb.run_many(requests))

    def close(self):
        self.call(self.sb.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def uids(self):
        base = self.sb._pool.uid_base
        return set(range(base, base + self.sb.workers))


def processes_of(uids) -> list[tuple[int, int, str]]:
    """(pid, uid, cmdline) of every live process on the host owned by one of `uids`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{name}")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if st.st_uid in uids and state != "Z":
            found.append((int(name), st.st_uid, state))
    return found


def wait_no_processes(uids, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        left = processes_of(uids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _interpreter_entries() -> set[str]:
    """Top-level names under /tmp or /dev/shm that the interpreter itself occupies (a clone
    under /tmp, as in CI): the sandbox binds those read-only into every call's /tmp."""
    names = set()
    for p in interpreter_dirs():
        for mount_point in ("/tmp/", "/dev/shm/"):
            if p.startswith(mount_point):
                names.add(p[len(mount_point):].split("/", 1)[0])
    return names


INTERPRETER_ENTRIES = _interpreter_entries()


def ls(path: str) -> str:
    """Code for a call: the sorted entries of `path`, without the interpreter's own (see above)."""
    return f"sorted(set(__import__('os').listdir({path!r})) - {INTERPRETER_ENTRIES!r})"


def _calls_in(cgroup_dir: str) -> list[str]:
    """The pids in a slot's cgroup but its forker's."""
    pids = open(os.path.join(cgroup_dir, "cgroup.procs")).read().split()
    return [pid for pid in pids if process_name(int(pid)) not in (zygote_state.FORKER_NAME, None)]  # None: gone meanwhile


def leftover_work_files(sb: SyncSandbox) -> list[str]:
    """What is left of calls where the zygote's calls could write: its root's /tmp and /dev/shm
    (seen from the host through /proc/PID/root; each call mounts its own tmpfs over them, which
    must vanish with the call), and processes still in the slots' cgroups other than the slot's
    forker (which lives there: each call is born in the cgroup)."""
    root = f"/proc/{sb.sb.zygote_pid}/root"
    left = [f"/tmp/{n}" for n in os.listdir(f"{root}/tmp") if n not in INTERPRETER_ENTRIES]
    left += [f"/dev/shm/{n}" for n in os.listdir(f"{root}/dev/shm") if n not in INTERPRETER_ENTRIES]
    tree = sb.sb._pool._cgroups
    if tree is not None:
        deadline = time.monotonic() + 5
        for slot in tree.slots:
            for d in slot.values():
                procs = _calls_in(d)
                while procs and time.monotonic() < deadline:
                    time.sleep(0.05)
                    procs = _calls_in(d)
                left += [f"{d}: pid {p}" for p in procs]
    return sorted(left)


def prometheus_total(text: str, sample: str) -> float:
    """The sum of every sample named `sample` (all label sets) in Prometheus exposition text,
    read with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == sample)
