"""Kernel-level confinement for the zygote: raw syscalls, the calls' minimal root, the seccomp filter.

Standard library plus pyseccomp (a ctypes binding of the system's libseccomp). Imported by
zygote/main.py as a top-level module (the zygote runs as a script), so it imports nothing of the
package.
"""

import ctypes
import errno
import os
import signal
import socket
import struct

CLONE_VFORK = 0x00004000
CLONE_PARENT = 0x00008000
CLONE_NEWNS = 0x00020000
CLONE_PARENT_SETTID = 0x00100000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACE_FLAGS = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER,
                   CLONE_NEWPID, CLONE_NEWNET)
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
SYS_READ = {"x86_64": 0, "aarch64": 63}.get(os.uname().machine)

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = ctypes.PyDLL(None, use_errno=True).syscall  # PyDLL: keeps the GIL across clone, as os.fork does
_syscall.restype = ctypes.c_long


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def sethostname(name):
    _check(_libc.sethostname(name.encode(), ctypes.c_size_t(len(name.encode()))), "sethostname")


def setns(fd, nstype):
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source, target, fstype, flags=0, data=None):
    _check(_libc.mount(source.encode() if source else None, target.encode(),
                       fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                       data.encode() if data else None), f"mount {target}")


def umount(target):
    _check(_libc.umount2(target.encode(), ctypes.c_int(MNT_DETACH)), f"umount {target}")


def madvise(address, length, advice):
    """madvise(2); False where the kernel refuses (advice only: never an error)."""
    return _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0


def prctl(option, arg, arg3=0):
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(arg3),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl")


def set_process_name(name):
    """This process's name in /proc/<pid>/comm (at most 15 bytes)."""
    _check(_libc.prctl(ctypes.c_int(PR_SET_NAME), ctypes.c_char_p(name.encode()[:15]), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), "prctl")


def pivot_root(new_root, put_old):
    _check(_syscall(ctypes.c_long(SYS_PIVOT_ROOT), new_root.encode(), put_old.encode()), "pivot_root")


def clone(flags, parent_tid=None):
    """fork() that also takes CLONE_* flags (CLONE_NEWPID: the child is PID 1 of a new namespace).

    Python cannot unshare(CLONE_NEWPID) twice in one process, and a fork per call plus a fork
    inside it doubles the cost; the raw clone syscall with the interpreter's own before/after-fork
    hooks (what os.fork runs) gives one fork per call.

    parent_tid: with CLONE_PARENT_SETTID, the address (an int) where the kernel stores the child's
    pid before the child runs (and, with CLONE_VFORK, before this call returns).
    """
    if SYS_CLONE is None:
        raise OSError(errno.ENOSYS, f"clone: unsupported machine {os.uname().machine}")
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _syscall(ctypes.c_long(SYS_CLONE), ctypes.c_ulong(flags | signal.SIGCHLD),
                   None, None if parent_tid is None else ctypes.c_void_p(parent_tid), None, None)
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


# ------------------------------------------------------------------------------------------------
# the calls' root file system

DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")  # the dynamic loader's cache; the time zone


def _bind_read_only(source, target, *, devices=False):
    mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (0 if devices else MS_NODEV)
    mount(None, target, None, flags)


def _make_mount_point(root, path, below="/"):
    """The directory `root + path` for a bind mount, its ancestors under `below` made
    traverse-only (0711): a call reaches the interpreter through them but cannot list them, so a
    venv inside a checkout shows nothing of the checkout, not even its own name in it (issue 69)."""
    os.makedirs(root + path, 0o755, exist_ok=True)
    parent = os.path.dirname(path)
    while parent.startswith(below) and parent != below.rstrip("/") and parent not in ("/", ""):
        os.chmod(root + parent, 0o711)
        parent = os.path.dirname(parent)


def _mirror(host_path, root):
    """Recreate `host_path` inside `root`: a symlink stays a symlink, a directory is bound read-only."""
    inside = root + host_path
    if os.path.islink(host_path):
        os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
        if not os.path.lexists(inside):
            os.symlink(os.readlink(host_path), inside)
    elif os.path.isdir(host_path):
        os.makedirs(inside, 0o755, exist_ok=True)
        _bind_read_only(host_path, inside)


ROOT_MOUNT_CANDIDATES = ("/mnt", "/media", "/srv", "/tmp", "/var/tmp")


def root_mount_point(needed):
    """An existing directory to build the root on (a tmpfs over it) that hides nothing the root
    needs: not an ancestor of the interpreter's directories (a venv under /tmp, e.g. a clone in
    /tmp, would otherwise be covered before it is bound) nor of the system's."""
    needed = list(needed) + ["/usr", "/dev", "/etc", "/bin", "/lib", "/lib64", "/sbin"]
    for candidate in ROOT_MOUNT_CANDIDATES:
        if os.path.isdir(candidate) and not os.path.islink(candidate) and not any(
                n == candidate or n.startswith(candidate + "/") for n in needed):
            return candidate
    raise OSError(errno.ENOENT, f"no directory to build the sandbox root on among {ROOT_MOUNT_CANDIDATES} "
                                f"that does not contain {needed}")


def build_minimal_root(root, interpreter_dirs):
    """Populate the (mounted, empty) tmpfs `root` with what a Python call needs and nothing else.

    Read-only: /usr (system libraries), the merged-/usr links (/bin, /lib, ...), the interpreter's
    prefix directories at their own paths, and two files of /etc. A minimal /dev (null, zero, full,
    random, urandom, fd links); empty mount points /tmp, /dev/shm and /proc that each call fills
    with its own tmpfs and proc. No /sys, /run, /home, /root contents, repo, data or host sockets.
    """
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.lexists(path):
            _mirror(path, root)
    for path in interpreter_dirs:
        if path != "/usr" and not path.startswith("/usr/"):  # /usr is bound whole above
            # a directory, even where a link leads to it: the link's target may be nowhere in the root
            _make_mount_point(root, path)
            _bind_read_only(os.path.realpath(path), root + path)
    os.makedirs(root + "/etc", 0o755, exist_ok=True)
    for path in ETC_FILES:
        if os.path.isfile(path):
            with open(root + path, "w"):
                pass
            _bind_read_only(path, root + path)
    for d in ("/tmp", "/proc", "/dev", "/dev/shm"):
        os.makedirs(root + d, 0o755, exist_ok=True)
    for name in DEVICES:
        with open(f"{root}/dev/{name}", "w"):
            pass
        _bind_read_only(f"/dev/{name}", f"{root}/dev/{name}", devices=True)
    os.symlink("/proc/self/fd", root + "/dev/fd")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")


def enter_root(root):
    """pivot_root into `root`, drop every host mount, make / read-only."""
    os.mkdir(root + "/.old", 0o700)
    pivot_root(root, root + "/.old")
    os.chdir("/")
    umount("/.old")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


CALL_MOUNT_POINTS = ("/tmp", "/dev/shm")


def covered_by_call_mounts(dirs):
    """The interpreter directories a call's own /tmp or /dev/shm would hide (a venv in a clone
    under /tmp): each call binds them back (read-only) into its fresh tmpfs."""
    return [d for d in dirs if any(d.startswith(m + "/") for m in CALL_MOUNT_POINTS)]


def mount_call_filesystems(uid, tmpfs_bytes, rebind=()):
    """In a call's own mount namespace: a fresh /tmp and /dev/shm owned by the call, its own /proc."""
    keep = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in rebind]  # before they are covered
    opts = f"size={tmpfs_bytes},nr_inodes=16384,mode=0700,uid={uid},gid={uid}"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for d, fd in zip(rebind, keep):
        _make_mount_point("", d, below=next(m for m in CALL_MOUNT_POINTS if d.startswith(m + "/")) + "/")
        _bind_read_only(f"/proc/self/fd/{fd}", d)
        os.close(fd)


def seal_call_proc():
    """Make the call's own /proc read-only, once the call has named itself through it: no write
    under /proc/self then succeeds, whatever the call does first. The one that matters is
    oom_score_adj: the kernel's floor (oom_score_adj_min) is set only by a writer holding
    CAP_SYS_RESOURCE, which root lacks on some hosts, and prctl(PR_SET_DUMPABLE, 1) gives a call its
    own /proc/self files, so it could otherwise lower its score below 1000. A call cannot remount:
    it has no capabilities and cannot make a user namespace (seccomp)."""
    mount(None, "/proc", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


# ------------------------------------------------------------------------------------------------
# seccomp

# The filter is an allow-list (syscall_policy.py: what it allows, why, and how it was measured).
#
# Where it goes: installing one costs ~0.4 ms whatever its size (measured here), a third of a
# trivial call. With strict isolation it is installed once per worker, which the calls inherit;
# the worker itself still needs the namespace and mount calls to set each call up, so those
# (syscall_policy.WORKER_SYSCALLS, and clone with the namespace flags the worker uses) are in its
# variant. A call cannot use them anyway: it runs as a non-root uid with no capabilities and
# no_new_privs, and each needs CAP_SYS_ADMIN; the one way around that, a new user namespace, is
# refused by both. Without strict isolation (possibly root, no uid switch) each call loads the
# call's filter.
WORKER_CLONE_FLAGS = (CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS | CLONE_NEWNET)
WORKER_UNSHARE_FLAGS = CLONE_NEWCGROUP  # a forker's and a session's own cgroup namespace
ALL_NAMESPACE_FLAGS = sum(NAMESPACE_FLAGS)
ALLOWED_SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)


def _allow(f, sc, name, *args):
    try:
        f.add_rule(sc.ALLOW, name, *args)
    except (OSError, ValueError, RuntimeError):
        pass  # not a syscall on this architecture / libseccomp version


def seccomp_program(*, for_worker=False):
    """The filter as a raw BPF program (bytes), built once with libseccomp; None without libseccomp.

    for_worker: the variant a strict worker installs on itself (see syscall_policy.WORKER_SYSCALLS).
    """
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError):  # the binding, or the system's libseccomp, is missing
        return None
    from . import syscall_policy
    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    try:  # a binary tree over syscall numbers: ~8 comparisons a syscall instead of a scan of the list
        f.set_attr(sc.Attr.CTL_OPTIMIZE, 2)
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass  # libseccomp before 2.5: the list in priority order
    names = syscall_policy.CALL_SYSCALLS + (syscall_policy.WORKER_SYSCALLS if for_worker else ())
    for name in names:
        if name != "unshare":
            _allow(f, sc, name)
    if for_worker:  # unshare: a cgroup namespace only
        _allow(f, sc, "unshare", sc.Arg(0, sc.MASKED_EQ, ALL_NAMESPACE_FLAGS & ~WORKER_UNSHARE_FLAGS, 0))
    # clone: no namespace flag (the worker: only those it sets calls up with)
    allowed_ns = WORKER_CLONE_FLAGS if for_worker else 0
    _allow(f, sc, "clone", sc.Arg(0, sc.MASKED_EQ, ALL_NAMESPACE_FLAGS & ~allowed_ns, 0))
    # clone3 passes its flags in a struct seccomp cannot read: make it look absent, so libc falls
    # back to clone, whose flags are checked above.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for value in syscall_policy.PERSONALITY_VALUES:
        _allow(f, sc, "personality", sc.Arg(0, sc.EQ, value))
    # socket(): only unix (within the call's own namespaces), IPv4 and IPv6 (no interfaces are up);
    # another family is EAFNOSUPPORT, as on a kernel built without it.
    top = max(ALLOWED_SOCKET_FAMILIES)
    for family in range(top + 1):
        if family in ALLOWED_SOCKET_FAMILIES:
            _allow(f, sc, "socket", sc.Arg(0, sc.EQ, family))
        else:
            f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.GT, top))
    fd = os.memfd_create("seccomp-bpf")
    try:
        f.export_bpf(open(fd, "wb", closefd=False))
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program):
    """Install a BPF program from seccomp_program() on this process (needs no_new_privs first)."""
    n = len(program) // struct.calcsize("HBBI")
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(n, ctypes.cast(buf, ctypes.c_void_p))
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog))
