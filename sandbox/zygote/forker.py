"""The forker: the one process of a worker that clones calls, and runs no Python while a call lives.

Every page a process writes after a fork is copied (or, once the child is gone, re-taken) in a
page fault; a worker that forked each call and then ran its supervision loop in Python while
the call ran took ~220 such faults a call. So each worker forks, once, a forker that does
nothing but clone calls: with CLONE_VFORK it sleeps in the kernel while the call lives, and
with CLONE_PARENT the call is the worker's child, which the worker supervises (pidfd, wait4)
without ever having forked it. The forker receives only file descriptors (the call's memfds and
pipes), never a call's data. Measured: +10% trivial calls/s over HTTP on 2 cores, together with
warm_up and starting the zygote from bytecode (zygote/start.py).

Imported as a top-level sibling by zygote/main.py (no package inside the zygote: see its docstring)."""

import _signal
import mmap
import os
import select
import signal
import socket
import struct
import time

from . import cgroups
from . import confine
from . import closer as zygote_closer
from . import splice as zygote_splice
from . import usercode as zygote_usercode
from .confine import (CLONE_NEWCGROUP, CLONE_NEWIPC, CLONE_NEWNS, CLONE_NEWPID, CLONE_PARENT, CLONE_PARENT_SETTID, CLONE_VFORK,
                     PR_SET_PDEATHSIG)
from .child import enter_call
from .state import FORKER_NAME
from .usercode import make_streams, warm_up

FORK_STUCK_S = 10.0  # no clone this long after a call's deadline: the forker is stuck
_FORKER_REQUEST = struct.Struct(">I")  # the call's CPU seconds; then its workdir (not strict), UTF-8
FORKER = []  # the worker's Forker (one, made by worker_loop)


class Forker:
    """The worker's handle on its forker process (see above)."""

    def __init__(self, zygote, slot):
        self.zygote, self.slot = zygote, slot
        self.start()

    def start(self):
        # The page where the kernel stores each call's pid (CLONE_PARENT_SETTID writes it in the
        # forker, the worker reads it): shared by these two processes and by no other. Both mark it
        # MADV_DONTFORK once the forker exists, so neither a call (cloned by the forker) nor a
        # session (cloned by the worker) has it mapped: a call that could write it would choose the
        # pid its worker waits on and SIGKILLs at the deadline (issue 79). A new forker gets a new page.
        self.pid_page = mmap.mmap(-1, mmap.PAGESIZE)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            self.pid_page.madvise(mmap.MADV_DONTFORK)
            forker_loop(theirs, self.zygote, self.slot, self.pid_page)
        self.pid_page.madvise(mmap.MADV_DONTFORK)
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
    for closer in zygote_closer.CLOSER:  # closed below, with every fd of the worker's but the calls' cgroup
        closer.detach()
    zygote_closer.CLOSER.clear()
    # Into the slot's cgroup, so that every call is born there. Moving a process between cgroups
    # takes a lock that, after a few ms without moves, first waits for an RCU grace period: a
    # call that joined the cgroup itself paid ~7 ms after any pause (0.1 ms under load).
    zygote.runtime.forker_in_cgroup = bool(zygote.runtime.cgroup_fds)
    if zygote.runtime.cgroup_fds:
        cgroups.join(zygote.runtime.cgroup_fds)
    if zygote.settings.strict:  # calls see their slot's cgroup as "/", not the service's path on the host
        confine.unshare(CLONE_NEWCGROUP)
    keep = sorted({0, 1, 2, sock.fileno()})
    for low, high in zip(keep, keep[1:] + [1 << 16]):
        os.closerange(low + 1, high)
    zygote_splice.DEVNULL.clear()
    # what every call would otherwise set for itself (see child._confine), inherited: its environment
    # (the OpenBLAS thread settings were read when numpy was imported) and SIGPIPE's default
    os.environ.clear()
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    warm_up()
    zygote_usercode.CALL_STREAMS = make_streams()
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
            enter_call(cpu_seconds, zygote, slot, *fds)
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
