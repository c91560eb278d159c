"""Stateful sessions (sandbox.Session): a live, isolated interpreter per trajectory."""

import asyncio
import os
import time

import pytest

import sandbox
from tests.sandbox.helpers import ls, processes_of


def scenario(fn, **kwargs):
    async def go():
        kwargs.setdefault("preload", ("math",))
        async with sandbox.LocalSandbox(workers=2, **kwargs) as sb:
            return await fn(sb)
    return asyncio.run(go())


def test_variables_persist_and_each_call_has_its_own_stdin_and_repr():
    async def fn(sb):
        async with await sb.session() as s:
            return [await s.run("x = 20"), await s.run("x += 1\nx * 2"), await s.run("print(input() * x)", stdin="ab"),
                    await s.run("def f(n):\n    return n + x\nf(1)"), await s.run("1/0"), await s.run("f(2)")]

    rs = scenario(fn)
    assert [r.stdout for r in rs] == ["", "42\n", "ab" * 21 + "\n", "22\n", "", "23\n"]
    assert [r.status for r in rs] == ["ok", "ok", "ok", "ok", "error", "ok"]
    assert "ZeroDivisionError" in rs[4].stderr


def test_sessions_and_stateless_calls_do_not_see_each_other():
    async def fn(sb):
        a, b = await sb.session(), await sb.session()
        await a.run("secret = 'from-a'\nopen('/tmp/a.txt', 'w').write('a')")
        seen = await asyncio.gather(
            b.run(f"print('secret' in globals(), {ls('/tmp')})"),
            sb.run(f"print({ls('/tmp')})"),
            a.run(f"print(secret, {ls('/tmp')})"))
        uids = await asyncio.gather(a.run("import os; os.getuid()"), b.run("import os; os.getuid()"))
        await a.close()
        await b.close()
        return seen, uids

    (b_view, stateless_view, a_view), uids = scenario(fn)
    assert b_view.stdout == "False []\n" and stateless_view.stdout == "[]\n"
    assert a_view.stdout == "from-a ['a.txt']\n"
    assert uids[0].stdout != uids[1].stdout


def test_background_processes_do_not_outlive_the_call():
    async def fn(sb):
        async with await sb.session() as s:
            await s.run("import os, time\nif os.fork() == 0:\n    time.sleep(0.5)\n    open('/tmp/late', 'w').write('x')\n"
                        "    os._exit(0)\nprint('parent')")
            await asyncio.sleep(1.0)
            return await s.run(f"import os\nprint({ls('/tmp')}, len([p for p in os.listdir('/proc') if p.isdigit()]))")

    assert scenario(fn).stdout == "[] 1\n"  # no file from the child, and only the interpreter is left


@pytest.mark.parametrize("code,status,timeout", [("while True:\n    pass", "timeout", 1.0),
                                                 ("x = bytearray(4 * 2**30)", "memory", 10.0),
                                                 ("import os\nos._exit(0)", "error", 1.0)])
def test_a_call_that_ends_the_interpreter_says_so_and_the_next_starts_fresh(code, status, timeout):
    async def fn(sb):
        async with await sb.session() as s:
            await s.run("kept = 1")
            ended = await s.run(code, timeout=timeout)
            after = await s.run("print('kept' in globals())")
            return ended, after, s.restarts

    ended, after, restarts = scenario(fn)
    assert ended.status == status and "earlier variables are gone" in ended.stderr
    assert after.stdout == "False\n" and restarts == 1


def test_close_and_idle_timeout_leave_no_process_or_cgroup():
    async def fn(sb):
        s = await sb.session()
        await s.run("x = 1")
        idle = await sb.session()
        await idle.run("y = 2")
        parents = dict(sb._pool._cgroups.sessions)
        during = sorted(n for p in parents.values() for n in os.listdir(p) if os.path.isdir(os.path.join(p, n)))
        await s.close()
        deadline = time.monotonic() + 5
        while idle.id in sb._sessions and time.monotonic() < deadline:  # released once fully closed
            await asyncio.sleep(0.1)
        names = sorted(n for p in parents.values() for n in os.listdir(p) if os.path.isdir(os.path.join(p, n)))
        return idle.closed, during, names, {s.uid, idle.uid}

    closed, during, names, uids = scenario(fn, session_idle_timeout_s=0.5)
    assert len(set(during)) == 2  # each session had its own cgroup, under the sessions' parent
    assert closed and names == []  # the sessions' own cgroups are gone
    assert processes_of(uids) == []


def test_turn_20_costs_what_turn_1_costs():
    # The release replays every earlier cell on each call; a session runs only the new one.
    cell = "acc = acc + sum(i * i for i in range(20000)) if 'acc' in globals() else 0"

    async def fn(sb):
        async with await sb.session() as s:
            times = []
            for _ in range(20):
                r = await s.run(cell)
                times.append(r.duration_s)
            return times

    times = scenario(fn)
    assert max(times[-5:]) < 5 * max(min(times[:5]), 0.002)


def test_basic_isolation_sessions_keep_state_and_never_kill_outside_themselves():
    # Without its own PID namespace a session is not PID 1: killing "every other process" (-1)
    # would reach every process of the uid (root's: the machine), so it must not be done there.
    async def fn(sb):
        async with await sb.session() as s:
            return [await s.run("x = 3"), await s.run("x * 3")]

    with pytest.warns(RuntimeWarning):
        first, second = scenario(fn, isolation="basic")
    assert first.ok and second.stdout == "9\n"
    assert os.getppid() > 1 and os.path.exists(f"/proc/{os.getppid()}")  # we (and our parent) are alive


def test_a_thread_left_running_ends_the_session_and_never_writes_into_the_next_cell():
    """A cell's result holds what it wrote while it ran: a thread it leaves behind would write into
    later cells, so the interpreter ends with that cell (its result intact, the next cell fresh)."""
    async def fn(sb):
        async with await sb.session() as s:
            await s.run("x = 1")
            left = await s.run("import threading, time\n"
                               "def chatter():\n    while True:\n        print('late', flush=True)\n"
                               "        time.sleep(0.01)\n"
                               "threading.Thread(target=chatter, daemon=True).start()\nprint('cell')")
            await asyncio.sleep(0.3)
            after = await s.run("print('x' in globals())")
            joined = await s.run("import threading\nt = threading.Thread(target=print, args=('inner',))\n"
                                 "t.start(); t.join()\ny = 2")
            kept = await s.run("print(y)")
            return left, after, joined, kept

    left, after, joined, kept = scenario(fn)
    assert left.status == "ok" and "cell\n" in left.stdout and "threads running" in left.stderr
    assert after.status == "ok" and after.stdout == "False\n"  # a fresh interpreter: no "late" lines
    assert joined.status == "ok" and joined.stdout == "inner\n" and "threads" not in joined.stderr
    assert kept.stdout == "2\n"  # a thread that finished within its cell costs the session nothing


def test_sessions_are_spread_over_the_slots_and_the_cap_fails_fast():
    async def fn(sb):
        sessions = [await sb.session() for _ in range(4)]
        for s in sessions:
            await s.run("pass")
        slots = sorted(s._slot for s in sessions)
        start = time.monotonic()
        with pytest.raises(sandbox.SessionLimitError, match="all 4 sessions of this sandbox are open"):
            await sb.session(wait_s=0.2)
        waited = time.monotonic() - start
        await sessions[0].close()
        fifth = await sb.session(wait_s=0.2)  # a closed session's place is free again
        await fifth.run("pass")
        return slots, waited, fifth._slot

    slots, waited, fifth_slot = scenario(fn, max_sessions=4)
    assert slots == [0, 0, 1, 1]
    assert waited < 2.0
    assert fifth_slot == 0  # where the closed one was: the least-loaded slot


def test_all_sessions_together_stay_within_their_memory_budget():
    """Idle sessions hold memory between cells; all of them together are capped (one cgroup over
    every session's): past the budget the kernel ends a session, never the service or a call."""
    budget = 400 << 20

    async def fn(sb):
        assert sb.protections["cgroups"], "this test needs cgroups (the suite runs as root with them)"
        sessions = [await sb.session() for _ in range(5)]
        fills = [await s.run("buf = b'x' * (100 * 2**20)\nprint('held')", timeout=20) for s in sessions]
        alive = [await s.run("print(len(buf))") for s in sessions]
        call = await sb.run("print(sum(range(10)))")
        return fills, alive, call, sb._pool._cgroups.sessions_peak_bytes()

    fills, alive, call, peak = scenario(fn, sessions_memory_bytes=budget, max_sessions=8)
    holding = [r for r in alive if r.stdout == f"{100 * 2**20}\n"]
    assert 1 <= len(holding) <= 3, [(r.status, r.stdout, r.stderr[-80:]) for r in alive]
    ended = [f for f in fills if f.status == "memory"] + [r for r in alive if "has ended" in r.stderr]
    assert ended  # the budget was enforced on a session, with a result that says so
    assert call.status == "ok" and call.stdout == "45\n"
    assert peak is not None and peak <= budget


def test_a_cell_that_forges_its_end_is_waited_for_and_its_output_stays_its_own():
    """The end-of-cell byte is written by the session's loop, and a cell can write it too (same
    process): the worker takes a cell as finished only when the kernel shows the interpreter
    blocked reading its next cell, so a forged early end changes nothing."""
    async def fn(sb):
        async with await sb.session() as s:
            forged = await s.run("import os, time\nos.write(5, b'0')\ntime.sleep(0.5)\nprint('late')\n1/0")
            nxt = await s.run("print('next')")
            kept = await s.run("print(os.getpid() == 1, 'time' in globals())")
            return forged, nxt, kept

    forged, nxt, kept = scenario(fn)
    assert forged.stdout == "late\n" and forged.status == "error" and "ZeroDivisionError" in forged.stderr
    assert nxt.stdout == "next\n" and nxt.status == "ok"
    assert kept.stdout == "True True\n"  # the same interpreter all along
