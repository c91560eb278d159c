"""Where a trainer's weight exports live on its host, and how they are freed however it ends.

Each VLLMEngine writes its exports under `<sync base>/rstar2_sync_<pid>_<engine id>`: two copies of
the model, in /dev/shm by default, which is memory. They are freed
- at close (VLLMEngine.close), or at the interpreter's exit for an engine never closed (atexit);
- at SIGTERM (scancel, a SLURM time limit, `kill`): Python's default ends the process without
  running any `finally`, so the handler installed here deletes the live exports first, then ends
  the process as SIGTERM would have (or calls the handler that was there before). Python runs it
  in the main thread when that thread next runs bytecode: a main thread blocked in one long C call
  (a device wait) delays the exit until it returns;
- after SIGKILL or a crash, by the next trainer on the host (`remove_orphaned_exports`: the
  directories whose pid is gone).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import threading

log = logging.getLogger(__name__)

SYNC_ROOT_PREFIX = "rstar2_sync_"  # + the trainer's pid + "_" + the engine's id

_LIVE: set[str] = set()


def export_root(base: str, owner: object) -> str:
    """The directory of `owner`'s exports under `base`, registered to be freed at SIGTERM."""
    root = os.path.join(base, f"{SYNC_ROOT_PREFIX}{os.getpid()}_{id(owner):x}")
    if not _LIVE:
        atexit.register(_release_all)  # once per process (unregistered when the last one is released)
    _LIVE.add(root)
    _free_at_sigterm()
    return root


def release(root: str):
    """Delete `root` (the owner closes)."""
    shutil.rmtree(root, ignore_errors=True)
    _LIVE.discard(root)
    if not _LIVE:
        atexit.unregister(_release_all)


def _release_all():
    for root in list(_LIVE):
        release(root)


def _free_at_sigterm():
    """Install, once, a SIGTERM handler that deletes the live exports before the process ends.
    Only the main thread may install one; an engine built elsewhere leaves the handler as it is."""
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "frees_exports", False) or threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        _release_all()
        if callable(previous):
            return previous(signum, frame)
        if previous != signal.SIG_IGN:  # the default: end the process, by SIGTERM, as it would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    handler.frees_exports = True
    signal.signal(signal.SIGTERM, handler)


def remove_orphaned_exports(root: str) -> list[str]:
    """Delete the exports under `root` whose trainer process is gone (a crash or SIGKILL skips
    close() and the SIGTERM handler): each holds two copies of the model in /dev/shm, which is
    memory. Only for a directory of this host: a pid means nothing on another. Returns what was
    deleted."""
    removed = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        pid = name[len(SYNC_ROOT_PREFIX):].split("_", 1)[0]
        if not (name.startswith(SYNC_ROOT_PREFIX) and pid.isdigit()) or _alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    if removed:
        log.info("removed %d weight export(s) of trainers that are gone from %s", len(removed), root)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
