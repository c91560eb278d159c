"""What one code execution returns, and the limits it runs under."""

from __future__ import annotations

import dataclasses
from typing import Any

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "internal", "worker_died")


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """status: ok | error (exception or non-zero exit) | timeout (wall or CPU) | memory |
    output_limit (stdout/stderr over the cap: the call was stopped) | killed (died by a signal
    it did not get from the sandbox, e.g. a segfault) | internal (the sandbox failed, not the code) |
    worker_died (the sandbox process running the call was killed from outside, e.g. by the kernel's
    OOM killer: the call did not complete; running it again may succeed).
    """
    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    truncated: bool = False

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}; expected one of {STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExecResult":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    @classmethod
    def internal(cls, message: str) -> "ExecResult":
        return cls(status="internal", stderr=message)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-call resource limits, enforced by the kernel.

    With per-call cgroups (see sandbox.zygote.cgroups) memory, processes and CPU are budgets of the
    whole call (all its processes, shared memory included); without them they fall back to
    per-process rlimits (memory as address space on top of the zygote's own).
    """
    memory_bytes: int = 1 << 30          # the call's memory (cgroup) / address space (fallback)
    file_size_bytes: int = 16 << 20      # largest file the code may write
    open_files: int = 64
    processes: int = 32                  # processes + threads of one call (cgroup pids / RLIMIT_NPROC)
    cpus: float = 1.0                    # CPU share of one call (cgroup quota); CPU seconds <= cpus x timeout
    stdout_bytes: int = 64 << 10         # output past this stops the call: status output_limit
    stderr_bytes: int = 64 << 10
    tmpfs_bytes: int = 256 << 20         # the call's own /tmp (and again /dev/shm); counted in its memory
    max_timeout_s: float = 300.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_encodable(name: str, text: str):
    """JSON can carry lone surrogates ("\\ud800"); they are not text and cannot become UTF-8 bytes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: lone surrogate {text[e.start]!r} at "
                         f"index {e.start}") from None


def validate_request(code: Any, stdin: Any, timeout: Any, *, default_timeout: float,
                     max_timeout: float) -> float:
    """Check one request before it reaches a worker; returns the timeout to use.

    Raises ValueError with a message fit for an HTTP 400 body.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise ValueError(f"stdin must be a string, got {type(stdin).__name__}")
    for name, text in (("code", code), ("stdin", stdin)):
        _check_encodable(name, text)
    timeout = default_timeout if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}")
    if not 0 < timeout <= max_timeout:
        raise ValueError(f"timeout must be in (0, {max_timeout}] s, got {timeout}")
    return float(timeout)
