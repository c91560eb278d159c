"""Can a vLLM server read the files this trainer writes? (the `rollout.vllm.sync=files` check)

A files sync writes each bucket under `rollout.vllm.sync_dir` (default: this host's /dev/shm) and
asks every server to reload it from that path. A server on another host can only do that when the
directory is on a filesystem both hosts mount. Without this check the mistake shows at the first
sync, as the server's "file not found" deep in a reload, after the model and the data were loaded.

Both questions are answered from this host alone, at config time:
- is a server on this host? Its address is ours when we can bind a socket to it (exact for every
  interface, loopback included; no interface listing needed);
- is a directory shared? Its filesystem type, from /proc/self/mountinfo: tmpfs or a local disk's
  filesystem is this host's alone; NFS, Lustre, GPFS, CephFS, FUSE mounts and the like may be
  shared (we cannot tell whether the server's host mounts them too, so those pass).
"""

from __future__ import annotations

import os
import socket
import tempfile

# Filesystems that live on this host alone: a path on one is never seen by another host.
LOCAL_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "overlay",
                               "f2fs", "vfat", "exfat", "zfs", "squashfs"})


def default_sync_root() -> str:
    """Where exports go when rollout.vllm.sync_dir is not set: this host's /dev/shm (memory)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def is_this_host(host: str) -> bool:
    """True when `host` (a name or an address) is one of this host's addresses. A name that does
    not resolve here is not this host."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address[0], 0))
                return True
            except OSError:  # not an address of ours (EADDRNOTAVAIL), or no such family here
                continue
    return False


def filesystem_type(path: str, mountinfo: str | None = None) -> str:
    """The type of the filesystem `path` is on: the mount with the longest mount point that holds
    it (mountinfo: /proc/self/mountinfo's text, read when not given)."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        after = line.split(" - ", 1)[1].split()
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best) and after:
            best, fstype = point, after[0]
    return fstype


def unreadable_by_servers(server_hosts: list[str], sync_dir: str, mountinfo: str | None = None) -> str | None:
    """Why some servers cannot read exports written to `sync_dir` (None: they can, or we cannot
    tell). `server_hosts`: each server's host name or address."""
    remote = sorted(h for h in set(server_hosts) if not is_this_host(h))  # each host resolved once
    if not remote:
        return None
    fstype = filesystem_type(sync_dir, mountinfo)
    if fstype not in LOCAL_FILESYSTEMS:
        return None
    return (f"server(s) on {', '.join(remote)} run on other hosts, and {sync_dir} is on {fstype}, which only this "
            "host sees")
