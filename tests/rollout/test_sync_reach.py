"""The files sync's reach check (rollout/engines/vllm_engine/sync/reach.py): a server on another host cannot read
this host's /dev/shm, and the config check says so before a run starts."""

import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax.rl.config import RunConfig, base_config
from rstar2_jax.rollout.engines.vllm_engine.sync import reach

# 203.0.113.0/24 is TEST-NET-3 (RFC 5737), for documentation: not an address of this host (this
# machine type numbers its VMs in TEST-NET-1, 192.0.2.0/24, so that range is not used here).
ELSEWHERE = "203.0.113.7"


def mountinfo(*mounts: tuple[str, str]) -> str:
    """/proc/self/mountinfo lines for (mount point, filesystem type) pairs."""
    return "\n".join(f"{i + 20} 1 0:{i} / {point} rw,relatime shared:{i} - {fstype} src{i} rw"
                     for i, (point, fstype) in enumerate(mounts))


def test_this_host_is_recognised_by_every_name_and_address_and_others_are_not():
    names = ["127.0.0.1", "localhost"]
    try:  # the host's own name, where it resolves (not every machine lists it)
        names += [socket.gethostname(), *{a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}]
    except socket.gaierror:
        pass
    try:  # the address of the interface this host's outward traffic leaves by (a UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            names.append(s.getsockname()[0])
    except OSError:  # no route out: loopback only
        pass
    for host in names:
        assert reach.is_this_host(host), host
    assert not reach.is_this_host(ELSEWHERE)
    assert not reach.is_this_host("no-such-host.invalid")  # RFC 2606: never resolves


def test_a_path_s_filesystem_is_its_longest_mount_point_s():
    table = mountinfo(("/", "ext4"), ("/dev/shm", "tmpfs"), ("/mnt/shared", "nfs4"), ("/mnt/shared/scratch", "lustre"),
                      ("/mnt/my dir", "cephfs"))
    assert reach.filesystem_type("/dev/shm/rstar2", table) == "tmpfs"
    assert reach.filesystem_type("/mnt/shared/run1", table) == "nfs4"
    assert reach.filesystem_type("/mnt/shared/scratch/x/y", table) == "lustre"
    assert reach.filesystem_type("/mnt/sharedness", table) == "ext4"  # a name that begins like a mount point is not in it
    assert reach.filesystem_type("/mnt/my dir/x", table.replace("/mnt/my dir", "/mnt/my\\040dir")) == "cephfs"
    assert reach.filesystem_type("/dev/shm") in ("tmpfs", "unknown")  # this host's own table reads


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from("abc"), min_size=1, max_size=3), min_size=1, max_size=6, unique_by=tuple),
       st.lists(st.sampled_from("abc"), min_size=1, max_size=4))
def test_the_deepest_mount_holding_a_path_decides_its_type(mounts, path):
    """Law: the type returned is that of the longest mount point that is the path or one of its
    parents; the root mount holds every path."""
    points = ["/" + "/".join(m) for m in mounts]
    table = mountinfo(("/", "rootfs"), *[(p, f"fs{i}") for i, p in enumerate(points)])
    target = "/" + "/".join(path)
    holding = [(len(p), f"fs{i}") for i, p in enumerate(points) if target == p or target.startswith(p + "/")]
    assert reach.filesystem_type(target, table) == (max(holding)[1] if holding else "rootfs")


def test_servers_elsewhere_cannot_read_a_local_filesystem_but_can_read_a_shared_one():
    table = mountinfo(("/", "ext4"), ("/dev/shm", "tmpfs"), ("/shared", "nfs"))
    assert reach.unreadable_by_servers(["127.0.0.1", "localhost"], "/dev/shm", table) is None
    why = reach.unreadable_by_servers(["127.0.0.1", ELSEWHERE], "/dev/shm", table)
    assert ELSEWHERE in why and "tmpfs" in why and "127.0.0.1" not in why
    assert reach.unreadable_by_servers([ELSEWHERE], "/shared/sync", table) is None
    assert "ext4" in reach.unreadable_by_servers([ELSEWHERE], "/home/me/sync", table)


def vllm_config(**vllm) -> list:
    tree = base_config().to_dict()
    tree["rollout"]["engine"] = "vllm"
    tree["rollout"]["vllm"].update(vllm)
    return RunConfig.parse(tree)[1]


def test_the_config_check_refuses_a_files_sync_that_servers_on_other_hosts_cannot_read(tmp_path):
    problems = vllm_config(urls=[f"http://{ELSEWHERE}:8100", "http://127.0.0.1:8100"], sync_dir="/dev/shm")
    refused = [p for p in problems if p.path == "rollout.vllm.sync"]
    assert len(refused) == 1, problems
    message = str(refused[0])
    assert ELSEWHERE in message and "rollout.vllm.sync=pull" in message and "rollout.vllm.sync_dir" in message
    # the same servers on this host, or a pull sync: nothing to refuse
    assert not [p for p in vllm_config(urls=["http://localhost:8100"]) if p.path == "rollout.vllm.sync"]
    assert not [p for p in vllm_config(urls=[f"http://{ELSEWHERE}:8100"], sync="pull",
                                       fetch_urls=[f"http://{ELSEWHERE}:8101"])]
