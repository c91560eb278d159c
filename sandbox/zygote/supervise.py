"""A worker runs one call: the job's body into memfds (by splice), the call cloned by the worker's
forker, then supervised until it ends (timeout, output cap, cancellation) and its result decided
from what the kernel reports: exit status, rusage, the cgroup's OOM counter and whether the setup
pipe was closed before the code started.
Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import os
import select
import signal
import time

from . import cgroups
from . import wire
from . import forker as zygote_forker
from .closer import hold_mount_namespace, release_mount_namespace
from .splice import Sink, splice_exact
from .state import EOF_GRACE_S

def cpu_seconds(job):
    """A call's RLIMIT_CPU (soft): its wall-clock timeout plus one second."""
    return int(job["timeout"]) + 1


def signal_name(sig):
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
    pid = zygote_forker.FORKER[0].fork_call(cpu_seconds(job), runtime.workdir, child_fds, setup[0],
                               started + float(job["timeout"]))
    for fd in child_fds:
        os.close(fd)
        fds.remove(fd)
    sinks = {out[0]: Sink(out[0], limits["stdout_bytes"]), err[0]: Sink(err[0], limits["stderr_bytes"])}
    mount_ns = wait_status = None
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
                    kill_call(pid, zygote)
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
                    msg = wire.read_msg(job_fd)
                    if msg is None or msg.get("cancel") == job["id"]:
                        if reason is None:
                            reason = "cancelled"
                            kill_call(pid, zygote)
                        watch_jobs = False  # what follows a cancel (the pool's ping) is the next job's
                    continue
                if sinks[fd].drain() and reason is None and wait_status is None:
                    reason = "output_limit"
                    kill_call(pid, zygote)
        duration = time.monotonic() - started
        os.set_blocking(setup[0], False)  # never wait here, whoever might still hold the write end
        try:
            setup_done = os.read(setup[0], 1) == b"R"
        except BlockingIOError:
            setup_done = False
        oom = cgroups.oom_kills(runtime.cgroup_version, runtime.cgroup_fds) - oom_before if runtime.cgroup_fds else 0
        cpu_s = rusage.ru_utime + rusage.ru_stime
        out_sink, err_sink = sinks[out[0]], sinks[err[0]]
        header = result_header(wait_status, reason, job, duration, setup_done=setup_done, oom_kills=oom, cpu_s=cpu_s,
                         over_cap=out_sink.size > out_sink.cap or err_sink.size > err_sink.cap)
        return header, out_sink, err_sink
    except BaseException:
        for sink in sinks.values():
            sink.close()
        raise
    finally:
        if wait_status is not None and runtime.cgroup_fds:
            hand_on_clean(runtime, mount_ns)
        else:
            release_mount_namespace(mount_ns)


# A call that leaves more shared memory than this charged to its slot (files in its /tmp or
# /dev/shm, SysV segments) has it released before the slot takes the next call.
LEFTOVER_SHMEM_BYTES = 1 << 20
RELEASE_WAIT_S = 2.0


def hand_on_clean(runtime, mount_ns):
    """The slot handed to the next call only once the finished call's shared memory is uncharged.

    The call's /tmp and /dev/shm live as long as its mount namespace, which the closer frees in
    batches (zygote_closer: up to CLOSER_BATCH calls later), and its SysV segments until the
    kernel's worker frees its IPC namespace. Both are charged to the slot's cgroup, so a call that
    filled its tmpfs left the next one in the slot less memory than its limit (issue 69: 780 MB
    calls ended `memory` after 480 MB tmpfs fills). Such a call's namespace is dropped here, at
    once, and the worker waits (RELEASE_WAIT_S at most) for the kernel to uncharge its memory. A
    call that left nothing (nearly all) costs one read of memory.stat and keeps the closer's path."""
    version, fds = runtime.cgroup_version, runtime.cgroup_fds
    if cgroups.shmem_bytes(version, fds) < LEFTOVER_SHMEM_BYTES:
        release_mount_namespace(mount_ns)
        return
    if mount_ns is not None:
        os.close(mount_ns)  # the last reference: its tmpfs mounts go now, in this process
    deadline = time.monotonic() + RELEASE_WAIT_S
    while cgroups.shmem_bytes(version, fds) >= LEFTOVER_SHMEM_BYTES and time.monotonic() < deadline:
        time.sleep(0.001)


def result_header(wait_status, reason, job, duration, *, setup_done, oom_kills, cpu_s, over_cap):
    """The result header of a finished call: status and notes from what the kernel reported, and
    the output's size: over the cap is "output_limit" whether or not the kill landed before the
    call ended by itself (a race that would otherwise give the same code different statuses)."""
    notes = []
    if not setup_done and reason is None:
        return fail("the call could not start (its stderr says why)", duration)
    if over_cap and reason != "cancelled":
        reason = "output_limit"
    if os.WIFEXITED(wait_status):
        exit_code = os.WEXITSTATUS(wait_status)
        status = "ok" if exit_code == 0 else "error"
    else:
        sig = os.WTERMSIG(wait_status)
        exit_code = -sig
        if sig == signal.SIGXCPU and cpu_s >= cpu_seconds(job) - 0.05:  # the kernel's CPU limit, not a self-kill
            status = "timeout"
            notes.append("TimeoutError: CPU time limit exceeded")
        else:
            status = "killed"
            if reason is None and not oom_kills:
                notes.append(f"killed by {signal_name(sig)}")
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


def kill_call(pid, zygote):
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


def fail(message, duration=0.0):
    """The result header of a job the sandbox (not the code) failed."""
    return {"status": "internal", "exit_code": None, "duration_s": duration, "truncated": False,
            "notes": [f"sandbox internal error: {message}"]}
