"""Host-wide uid ranges: every sandbox on a host runs its calls under uids no other sandbox uses.

Calls of two sandboxes that shared a uid (a test suite beside a trainer, two trainers, two
pytest-xdist workers, two `serve` processes) would share what the kernel counts per uid
(RLIMIT_NPROC, signal permission, /proc visibility in basic isolation), and a check or cleanup
by uid in one would reach the other's calls. So each sandbox claims a block of uids for its
lifetime with an exclusive `flock` on a lock file per block: the kernel drops the lock when the
holder exits, however it exits (a SIGKILLed trainer frees its block), so nothing needs cleaning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile

FIRST_UID = 61000        # above the usual ranges of system and login users
BLOCK = 1024             # uids per block: a sandbox's slots + its sessions must fit in one
BLOCKS = 256             # 61000 .. 323143: blocks to try before giving up
LOCK_DIR = os.path.join(tempfile.gettempdir(), "rstar2-sandbox-uids")


class UidRangeError(RuntimeError):
    pass


class UidRange:
    """[base, base + width) held by this process until close()."""

    def __init__(self, base: int, width: int, fds: list[int]):
        self.base, self.width, self._fds = base, width, fds

    def close(self):
        for fd in self._fds:
            os.close(fd)  # releases the flock
        self._fds = []

    def __repr__(self):
        return f"UidRange({self.base}..{self.base + self.width - 1})"


def _lock_block(index: int) -> int | None:
    os.makedirs(LOCK_DIR, mode=0o1777, exist_ok=True)
    # read-only is enough for flock, and lets users other than its creator lock the same file
    fd = os.open(os.path.join(LOCK_DIR, f"block-{index}.lock"), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def claim(width: int, base: int | None = None) -> UidRange:
    """A block of `width` uids no other sandbox on this host holds: the first free block, or the
    blocks covering [base, base + width) when `base` is given (an error if another holds them)."""
    if width > BLOCK and base is None:
        raise UidRangeError(f"a sandbox needs {width} uids (slots + sessions), more than a block of {BLOCK}: "
                            f"pass uid_base explicitly or lower max_sessions")
    if base is not None:
        if base < FIRST_UID:
            raise UidRangeError(f"uid_base={base} is below {FIRST_UID}: the range could hold real users' uids")
        first, last = (base - FIRST_UID) // BLOCK, (base + width - 1 - FIRST_UID) // BLOCK
        fds = []
        for index in range(first, last + 1):
            fd = _lock_block(index)
            if fd is None:
                UidRange(base, width, fds).close()  # the blocks taken so far
                raise UidRangeError(f"uids {base}..{base + width - 1} overlap a block another sandbox on this host "
                                    f"holds ({FIRST_UID + index * BLOCK}..{FIRST_UID + (index + 1) * BLOCK - 1}): "
                                    f"choose another uid_base, or leave it unset to get a free block")
            fds.append(fd)
        return UidRange(base, width, fds)
    for index in range(BLOCKS):
        fd = _lock_block(index)
        if fd is not None:
            return UidRange(FIRST_UID + index * BLOCK, width, [fd])
    raise UidRangeError(f"all {BLOCKS} uid blocks from {FIRST_UID} are held by other sandboxes on this host")
