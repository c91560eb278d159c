"""A sandbox worker killed in the middle of a call (what the kernel's OOM killer does; every
sandbox process volunteers as its first victim) loses no call and no capacity (issue 28, item 1):
the call is answered once, with status worker_died, and the slot serves again at once."""

import asyncio
import os
import signal
import threading
import time

import pytest

import sandbox
from sandbox.zygote import state as zygote_state
from sandbox.pool import child_pids, process_name, running_calls


def kill_a_busy_worker(zygote_pid: int, deadline: float) -> int | None:
    """SIGKILL a worker (a child of the master zygote) while it supervises a call."""
    while time.monotonic() < deadline:
        for worker in child_pids(zygote_pid):
            if running_calls(worker):
                os.kill(worker, signal.SIGKILL)
                return worker
        time.sleep(0.02)
    return None


@pytest.mark.slow
def test_killed_workers_lose_no_call_and_no_capacity():
    rounds, workers = 4, 2

    async def go():
        async with sandbox.LocalSandbox(workers=workers, preload=("math",), default_timeout=30.0) as sb:
            zygote = sb._pool.zygote_pid
            killed, results = [], []
            for r in range(rounds):  # under load: more calls than slots, one worker killed per round
                calls = [sb.run(f"import time\ntime.sleep(1.5)\nprint('done {r}-{i}')") for i in range(3 * workers)]
                killer = threading.Thread(target=lambda: killed.append(kill_a_busy_worker(zygote, time.monotonic() + 20)))
                killer.start()
                results.append(await asyncio.gather(*calls))
                killer.join()
            # every slot serves again: `workers` calls of 2 s side by side take ~2 s, not 2 x 2 s
            start = time.monotonic()
            after = await sb.run_many([{"code": "import time\ntime.sleep(2)\nprint('after')"}] * workers)
            return killed, results, after, time.monotonic() - start, sb._pool.zygote_pid == zygote

    killed, results, after, wall, same_zygote = asyncio.run(go())
    assert all(killed) and len(set(killed)) == rounds
    assert same_zygote  # workers were replaced, not the whole sandbox
    for r, round_results in enumerate(results):
        statuses = [x.status for x in round_results]
        assert statuses.count("worker_died") == 1, statuses
        assert statuses.count("ok") == len(statuses) - 1, statuses
        died = next(x for x in round_results if x.status == "worker_died")
        assert "WorkerDied" in died.stderr and "SIGKILL" in died.stderr and died.stdout == ""
        for i, x in enumerate(round_results):  # each answer is its own call's, once
            assert x.status == "worker_died" or x.stdout == f"done {r}-{i}\n", (i, x)
    assert [x.stdout for x in after] == ["after\n"] * workers
    assert wall < 3.5, wall


def _forkers(zygote_pid: int, expected: int) -> dict[int, int]:
    """{worker: its forker} once every one of the `expected` workers has one (each worker forks
    its forker as it starts, just after the zygote reports ready)."""
    deadline = time.monotonic() + 10
    while True:
        found = {}
        for worker in child_pids(zygote_pid):
            for pid in child_pids(worker):
                if process_name(pid) == zygote_state.FORKER_NAME:
                    found[worker] = pid
        if len(found) == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_calls_are_the_workers_children_cloned_by_a_forker_that_sleeps_while_they_run():
    """The worker supervises a call it did not fork (zygote/forker.Forker): the call is the worker's child,
    and the forker that cloned it waits in the kernel (vfork) until it is gone."""

    async def go():
        async with sandbox.LocalSandbox(workers=1, preload=("math",), default_timeout=30.0) as sb:
            (worker, forker), = _forkers(sb._pool.zygote_pid, 1).items()
            call = asyncio.ensure_future(sb.run("import time\ntime.sleep(1.0)\nprint('slept')"))
            deadline = time.monotonic() + 10
            while not running_calls(worker) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            calls, forker_state = running_calls(worker), _state(forker)
            result = await call
            after = await sb.run("print('after')")
            deadline = time.monotonic() + 5  # it closes the call's fds, then waits for the next request
            while _state(forker) != "S" and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return calls, forker_state, child_pids(forker), result, after, _state(forker)

    calls, forker_state_during, forker_children, result, after, forker_state_after = asyncio.run(go())
    assert len(calls) == 1 and forker_children == []  # the call is the worker's child, not the forker's
    assert forker_state_during == "D"  # asleep in clone(CLONE_VFORK) while the call runs
    assert forker_state_after == "S"   # back to waiting for the next request
    assert (result.status, result.stdout, after.stdout) == ("ok", "slept\n", "after\n")


def test_a_killed_forker_is_replaced_and_no_call_is_lost():
    """SIGKILL every forker (the OOM killer's choice as much as any sandbox process): each worker
    starts a new one for its next call, which runs normally; the zygote stays."""

    async def go():
        async with sandbox.LocalSandbox(workers=2, preload=("math",), default_timeout=30.0) as sb:
            zygote = sb._pool.zygote_pid
            first = await sb.run_many([{"code": "print('before')"}] * 2)
            old = _forkers(zygote, 2)
            for forker in old.values():
                os.kill(forker, signal.SIGKILL)
            await asyncio.sleep(0.2)
            results = await sb.run_many([{"code": f"print({i})"} for i in range(6)])
            return old, _forkers(zygote, 2), first, results, sb._pool.zygote_pid == zygote

    old, new, first, results, same_zygote = asyncio.run(go())
    assert len(old) == 2 and set(new) == set(old)  # the same workers ...
    assert not set(new.values()) & set(old.values())  # ... with new forkers
    assert [r.stdout for r in first] == ["before\n"] * 2
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i}\n") for i in range(6)]
    assert same_zygote


def test_each_call_is_born_in_its_slots_cgroup_where_its_forker_lives():
    """The forker sits in its slot's cgroup, so a call starts there instead of moving in (a move
    waits for an RCU grace period after any pause, ~7 ms a call); the cgroup holds the forker and
    the call, and the pids limit counts one more for the forker."""

    async def go():
        async with sandbox.LocalSandbox(workers=1, preload=("math",), default_timeout=30.0) as sb:
            tree = sb._pool._cgroups
            if tree is None:
                pytest.fail("this test needs the cgroups the sandbox uses on CI machines (v1 or v2)")
            (worker, forker), = _forkers(sb._pool.zygote_pid, 1).items()
            call = asyncio.ensure_future(sb.run("import time\ntime.sleep(1.0)\nprint(open('/proc/self/cgroup').read())"))
            deadline = time.monotonic() + 10
            while not running_calls(worker) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            calls = running_calls(worker)
            slot = tree.slots[0]
            members = {c: set(map(int, open(os.path.join(d, "cgroup.procs")).read().split())) for c, d in slot.items()}
            pids_max = open(os.path.join(slot["pids" if "pids" in slot else ""], "pids.max")).read().strip()
            return calls, forker, members, pids_max, await call, sb.limits.processes

    calls, forker, members, pids_max, result, processes = asyncio.run(go())
    assert len(calls) == 1
    for controller, pids in members.items():
        assert {forker, calls[0]} <= pids, (controller, pids)
    assert int(pids_max) == processes + 1
    # the kernel has it in the slot's cgroup (above); it sees that cgroup as its own root (a cgroup
    # namespace: nothing of the service's cgroup path on the host)
    assert result.status == "ok" and set(line.rsplit(":", 1)[1] for line in result.stdout.split()) == {"/"}
