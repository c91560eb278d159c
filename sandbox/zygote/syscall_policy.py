"""The seccomp allow-list: the system calls a call may make, and those its worker adds to set calls up.

Data only (standard library, no imports): confine.seccomp_program builds the filter from it, and
the zygote imports this as a top-level sibling. Everything not listed is refused with EPERM
(clone3 with ENOSYS, so that libc falls back to clone, whose flags the filter can read).

Where it comes from (issue 79): Docker's default profile (moby/moby profiles/seccomp/default.json,
its unconditional allow-list; tests/sandbox/docker_default_syscalls.py keeps a copy), minus what
math code never needs and a call could use to reach past itself:

- asynchronous I/O (io_setup & co., io_uring): io_setup takes from a host-wide pool
  (fs.aio-max-nr); one call could take all of it;
- inotify/fanotify, flock, posix_fadvise, sync/syncfs: ways for two concurrent calls to signal
  each other through shared read-only files, or to drop or flush the host's page cache;
- memfd_secret, pkeys, landlock, process_mrelease, remap_file_pages, personality beyond the
  values Docker allows (never READ_IMPLIES_EXEC), adjtimex/clock_adjtime (even read-only), and
  name_to_handle_at: unused by Python, numpy or sympy, each extra kernel surface.

What Python, numpy and sympy need was measured: sandbox/syscall_corpus.py runs under
`strace -f` (experiments/benchmarks/sandbox_syscalls.py prints what the zygote's processes
called), and every name it saw is here; tests/sandbox/test_supervisor_boundary.py checks the
measured set against this list, this list against Docker's, and that the syscalls Docker
refuses are refused from inside a call.
"""

# A call's own system calls (every architecture's names; those a kernel lacks are skipped).
CALL_SYSCALLS = (
    # files and directories (the call's own /tmp; the read-only root)
    "access", "chdir", "chmod", "chown", "close", "close_range", "copy_file_range", "creat", "dup", "dup2", "dup3",
    "faccessat", "faccessat2", "fallocate", "fchdir", "fchmod", "fchmodat", "fchown", "fchownat", "fcntl",
    "fdatasync", "fgetxattr", "flistxattr", "fremovexattr", "fsetxattr", "fstat", "fstatfs", "fsync", "ftruncate",
    "futimesat", "getcwd", "getdents", "getdents64", "getxattr", "lchown", "lgetxattr", "link", "linkat",
    "listxattr", "llistxattr", "lremovexattr", "lseek", "lsetxattr", "lstat", "mkdir", "mkdirat", "mknod",
    "mknodat", "newfstatat", "open", "openat", "openat2", "pread64", "preadv", "preadv2", "pwrite64", "pwritev",
    "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv", "removexattr", "rename", "renameat",
    "renameat2", "rmdir", "sendfile", "setxattr", "splice", "stat", "statfs", "statx", "symlink", "symlinkat",
    "sync_file_range", "tee", "truncate", "umask", "unlink", "unlinkat", "utime", "utimensat", "utimes",
    "vmsplice", "write", "writev", "ioctl", "memfd_create", "pipe", "pipe2",
    # memory
    "brk", "madvise", "membarrier", "mincore", "mlock", "mlock2", "mlockall", "mmap", "mprotect", "mremap",
    "msync", "munlock", "munlockall", "munmap",
    # processes, threads, signals, time
    "arch_prctl", "capget", "capset", "clock_getres", "clock_gettime", "clock_nanosleep", "execve", "execveat",
    "exit", "exit_group", "fork", "futex", "futex_waitv", "get_robust_list", "get_thread_area", "getcpu",
    "getegid", "geteuid", "getgid", "getgroups", "getitimer", "getpgid", "getpgrp", "getpid", "getppid",
    "getpriority", "getrandom", "getresgid", "getresuid", "getrlimit", "getrusage", "getsid", "gettid",
    "gettimeofday", "getuid", "ioprio_get", "ioprio_set", "kill", "nanosleep", "pause", "pidfd_open",
    "pidfd_send_signal", "prctl", "prlimit64", "restart_syscall", "rseq", "rt_sigaction", "rt_sigpending",
    "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "rt_tgsigqueueinfo",
    "sched_get_priority_max", "sched_get_priority_min", "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_getscheduler", "sched_rr_get_interval", "sched_setaffinity", "sched_setattr", "sched_setparam",
    "sched_setscheduler", "sched_yield", "seccomp", "set_robust_list", "set_thread_area", "set_tid_address",
    "setfsgid", "setfsuid", "setgid", "setgroups", "setitimer", "setpgid", "setpriority", "setregid",
    "setresgid", "setresuid", "setreuid", "setrlimit", "setsid", "setuid", "sigaltstack", "signalfd",
    "signalfd4", "sysinfo", "tgkill", "time", "timer_create", "timer_delete", "timer_getoverrun",
    "timer_gettime", "timer_settime", "timerfd_create", "timerfd_gettime", "timerfd_settime", "times", "tkill",
    "uname", "vfork", "wait4", "waitid", "alarm",
    # waiting on fds
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_pwait2", "epoll_wait", "eventfd",
    "eventfd2", "poll", "ppoll", "pselect6", "select",
    # IPC within the call's own IPC namespace (multiprocessing's semaphores and queues)
    "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink", "msgctl", "msgget",
    "msgrcv", "msgsnd", "semctl", "semget", "semop", "semtimedop", "shmat", "shmctl", "shmdt", "shmget",
    # sockets (families: confine.ALLOWED_SOCKET_FAMILIES; no interfaces are up)
    "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt", "listen", "recvfrom",
    "recvmmsg", "recvmsg", "sendmmsg", "sendmsg", "sendto", "setsockopt", "shutdown", "socketpair",
)

# personality(2) with these arguments only (Docker's: PER_LINUX, PER_LINUX32 | UNAME26 forms, query).
PERSONALITY_VALUES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# What a strict worker (and the forker and calls that inherit its filter) adds to set each call and
# session up as root before it drops to its uid: its own mounts, the session's /proc through its
# mount namespace, the cgroup namespace. Docker allows each of them to holders of CAP_SYS_ADMIN
# only, which a call never has (non-root uid, no capabilities, no_new_privs; user namespaces refused).
WORKER_SYSCALLS = ("mount", "umount2", "setns", "unshare")

# What Docker's profile refuses that our earlier deny-list let through (issue 79), and the
# host-wide or cross-call ones above: refused, and checked from inside a call by the tests.
REFUSED_SYSCALLS = (
    "modify_ldt", "kcmp", "mbind", "set_mempolicy", "get_mempolicy", "move_pages", "migrate_pages", "sysfs",
    "ustat", "memfd_secret", "quotactl_fd", "io_setup", "io_submit", "io_uring_setup", "inotify_init1",
    "fanotify_init", "flock", "fadvise64", "sync", "syncfs", "ptrace", "process_vm_readv", "bpf", "keyctl",
    "perf_event_open", "userfaultfd", "pivot_root", "chroot", "sethostname",
)
