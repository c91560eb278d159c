"""Host-wide uid blocks (sandbox/uids.py): two sandboxes on one host never share a uid, and a
block is free again as soon as its holder is gone, however it went."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest

import sandbox
from sandbox import uids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_sandboxes_get_disjoint_uids_and_close_frees_them():
    async def go():
        async with sandbox.LocalSandbox(workers=1, max_sessions=4, preload=()) as a, \
                sandbox.LocalSandbox(workers=1, max_sessions=4, preload=()) as b:
            ranges = [(s._pool.uid_base, s._pool.uid_base + s.workers + s.max_sessions) for s in (a, b)]
            uid_a = (await a.run("import os; print(os.getuid())")).stdout.strip()
            held = a._uids
        return ranges, uid_a, held

    (ra, rb), uid_a, held = asyncio.run(go())
    assert ra[1] <= rb[0] or rb[1] <= ra[0]  # disjoint
    assert int(uid_a) == ra[0]               # the call ran under the first uid of its block
    assert held._fds == []                   # close() released the block
    again = uids.claim(5, held.base)         # ... so it can be taken again
    again.close()


def test_a_pinned_base_inside_a_held_block_is_refused_with_the_way_out():
    first = uids.claim(10)
    try:
        with pytest.raises(uids.UidRangeError, match="another sandbox on this host holds.*leave it unset"):
            uids.claim(4, first.base + 3)
        other = uids.claim(10)
        assert other.base >= first.base + uids.BLOCK or other.base + 10 <= first.base
        other.close()
    finally:
        first.close()


def test_a_killed_holder_frees_its_block():
    code = ("import sys, time\nfrom sandbox import uids\nr = uids.claim(8)\nprint(r.base, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    base = int(proc.stdout.readline())
    with pytest.raises(uids.UidRangeError):
        uids.claim(8, base)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    uids.claim(8, base).close()  # the kernel dropped the dead holder's lock


def test_bad_requests_say_what_to_do():
    with pytest.raises(uids.UidRangeError, match="lower max_sessions"):
        uids.claim(uids.BLOCK + 1)
    with pytest.raises(uids.UidRangeError, match="below"):
        uids.claim(4, 1000)
