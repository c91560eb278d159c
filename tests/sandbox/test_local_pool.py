"""LocalSandbox lifetime: ordering, backpressure, crash recovery, shutdown, isolation modes."""

import asyncio
import os
import signal
import time

import pytest

import sandbox
from sandbox import local
from tests.sandbox.helpers import SyncSandbox, wait_no_processes


def test_run_many_keeps_request_order(sb):
    results = sb.run_many([{"code": f"import time\ntime.sleep({0.05 * (i % 3)})\nprint({i})"} for i in range(12)])
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]


def test_backpressure_bounds_calls_in_flight():
    async def scenario():
        async with sandbox.LocalSandbox(workers=1, max_pending=2, preload=()) as sb:
            seen = []

            async def watch():
                while True:
                    seen.append(sb.in_flight)
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            results = await sb.run_many([{"code": "import time\ntime.sleep(0.05)\nprint('x')"}] * 8)
            watcher.cancel()
            return results, seen

    results, seen = asyncio.run(scenario())
    assert all(r.stdout == "x\n" for r in results)
    assert max(seen) == 2


def test_zygote_crash_mid_call_is_retried_and_loses_nothing():
    box = SyncSandbox(workers=2, preload=("math",))
    try:
        first_pid = box.sb.zygote_pid
        future = asyncio.run_coroutine_threadsafe(
            box.sb.run("import time\ntime.sleep(0.5)\nprint('finished')", timeout=5), box.loop)
        time.sleep(0.2)
        os.kill(first_pid, signal.SIGKILL)
        result = future.result(30)
        assert (result.status, result.stdout) == ("ok", "finished\n")
        assert box.sb.zygote_pid != first_pid
        assert box.run("print(6 * 7)").stdout == "42\n"
    finally:
        box.close()


def test_close_leaves_no_process_behind():
    box = SyncSandbox(workers=2, preload=("math",))
    zygote = box.sb.zygote_pid
    box.run_many([{"code": "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)", "timeout": 2}] * 2)
    box.close()
    assert not os.path.exists(f"/proc/{zygote}") or open(f"/proc/{zygote}/stat").read().split()[2] == "Z"
    assert wait_no_processes(box.uids) == []


def test_strict_isolation_refuses_without_privileges(monkeypatch):
    monkeypatch.setattr(local.os, "geteuid", lambda: 1000)
    with pytest.raises(sandbox.SandboxStartError, match="strict isolation needs root"):
        asyncio.run(sandbox.LocalSandbox(workers=1).start())


def test_basic_isolation_runs_with_rlimits_and_warns():
    async def scenario():
        with pytest.warns(RuntimeWarning, match="isolation='basic'"):
            sb = await sandbox.LocalSandbox(workers=1, isolation="basic", preload=("math",)).start()
        try:
            return [await sb.run("print(2 + 2)"), await sb.run("x = bytearray(8 * 2**30)"),
                    await sb.run("while True: pass", timeout=0.5)]
        finally:
            await sb.close()

    ok, memory, timeout = asyncio.run(scenario())
    # Without a cgroup, running out of memory is a MemoryError inside the call: the call could
    # raise that itself, so it is reported as the code's error, never as the supervisor's "memory".
    assert ok.stdout == "4\n" and memory.status == "error" and "MemoryError" in memory.stderr
    assert timeout.status == "timeout"


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        sandbox.LocalSandbox(workers=0)
    with pytest.raises(ValueError, match="isolation must be"):
        sandbox.LocalSandbox(isolation="none")


def test_not_started_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not started"):
        asyncio.run(sandbox.LocalSandbox(workers=1).run("1"))


def test_timeouts_at_the_boundaries_say_timeout_and_cost_no_worker(sb):
    """The smallest timeouts (shorter than starting a process), many at once, and the largest
    allowed: each call is `timeout` (or `ok` when it finished first), never `worker_died`, and the
    zygote's workers are the same processes before and after (no slot restarted)."""
    from sandbox.zygote import state as zygote_state
    from sandbox.pool import child_pids, process_name
    from sandbox.result import Limits

    def workers():
        return sorted(p for p in child_pids(sb.sb.zygote_pid) if process_name(p) != zygote_state.CLOSER_NAME)

    before = workers()
    statuses = [sb.run("print(1)", timeout=t).status for t in (1e-9, 1e-6, 1e-4, 1e-3)]
    statuses += [r.status for r in sb.run_many([{"code": "x = 1", "timeout": 1e-6}] * 12)]
    assert set(statuses) <= {"timeout", "ok"} and statuses[:2] == ["timeout", "timeout"], statuses
    assert sb.run("print(2)", timeout=Limits().max_timeout_s).stdout == "2\n"
    assert workers() == before


def test_every_client_and_its_session_are_the_typed_interfaces():
    """LocalSandbox, RedisSandbox and HTTPSandbox are each a sandbox.SandboxClient and their
    sessions each a SandboxSession (sandbox/client.py): the same methods, with the same
    parameters, so code typed against the two never learns which backend it has."""
    import inspect

    from sandbox.client import SandboxClient, SandboxSession
    from sandbox.http_service.client import HTTPSandbox, HTTPSession
    from sandbox.local import LocalSandbox, Session
    from sandbox.redis_queue.client import RedisSandbox, RedisSession

    def params(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()][:4]

    for protocol, classes in ((SandboxClient, (LocalSandbox, RedisSandbox, HTTPSandbox)),
                              (SandboxSession, (Session, RedisSession, HTTPSession))):
        for cls in classes:
            for name in ("run", "run_many", "session", "close", "__aenter__", "__aexit__"):
                if not hasattr(protocol, name):
                    continue
                assert inspect.iscoroutinefunction(getattr(cls, name)), (cls, name)
                if name == "run":
                    assert params(getattr(cls, name)) == params(getattr(protocol, name)), cls
