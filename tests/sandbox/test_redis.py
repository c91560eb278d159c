"""Distributed mode against a real redis-server: delivery, redelivery, exactly one result,
expiry, and clients that never hang when Redis goes away."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from sandbox.redis_queue.client import RedisSandbox
from sandbox.redis_queue.protocol import Keys
from sandbox.redis_queue.worker import RedisWorker
from sandbox import uids
from sandbox.result import ExecResult
from tests.sandbox.helpers import wait_no_processes
from tests.sandbox.redis_server import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


# The killed worker's uids: the host's last block, which no sandbox that picks its own takes
# first (sandbox/uids.py), so the test knows whose processes to look for.
KILLED_WORKER_UID_BASE = uids.FIRST_UID + (uids.BLOCKS - 1) * uids.BLOCK


def start_worker(url, concurrency=2, visibility=1.5, uid_base=None):
    pinned = [] if uid_base is None else ["--uid-base", str(uid_base)]
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "worker", "--redis", url, "--concurrency",
                             str(concurrency), "--visibility-timeout", str(visibility), *pinned],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "sandbox worker" in proc.stdout.readline()
    return proc


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_jobs_run_on_workers_and_results_come_back_in_order(redis_server):
    worker = start_worker(redis_server.url)
    try:
        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
                single = await sb.run("print(input() * 2)", stdin="ab")
                many = await sb.run_many([{"code": f"print({i} ** 2)"} for i in range(20)])
                return single, many

        single, many = asyncio.run(scenario())
        assert (single.status, single.stdout) == ("ok", "abab\n")
        assert [r.stdout for r in many] == [f"{i ** 2}\n" for i in range(20)]
        r = redis.Redis.from_url(redis_server.url)
        assert r.xlen(Keys().jobs) == 0  # acknowledged and removed
        ttls = [r.ttl(k) for k in r.scan_iter("sandbox:done:*")]
        assert ttls and all(0 < t <= 600 for t in ttls)  # results expire
    finally:
        stop(worker)


def _pending(r) -> int:
    try:
        return r.xpending(Keys().jobs, Keys().group)["pending"]
    except redis.ResponseError:  # no group yet
        return 0


def test_killed_worker_job_is_redelivered_and_client_gets_exactly_one_result(redis_server):
    first = start_worker(redis_server.url, visibility=1.5, uid_base=KILLED_WORKER_UID_BASE)

    async def scenario():
        async with RedisSandbox(redis_server.url, queue_timeout_s=60) as sb:
            task = asyncio.create_task(sb.run("import time\ntime.sleep(1.0)\nprint('done')", timeout=10))
            r = redis.Redis.from_url(redis_server.url)
            deadline = time.monotonic() + 10
            while not _pending(r) and time.monotonic() < deadline:  # the worker has taken the job
                await asyncio.sleep(0.05)
            first.kill()  # mid-job, no chance to acknowledge
            first.wait()
            second = start_worker(redis_server.url, visibility=1.5)
            try:
                result = await task
            finally:
                stop(second)
            return result, r

    try:
        result, r = asyncio.run(scenario())
    finally:
        stop(first)  # already dead unless the scenario failed before killing it
    assert (result.status, result.stdout) == ("ok", "done\n")
    assert wait_no_processes({KILLED_WORKER_UID_BASE, KILLED_WORKER_UID_BASE + 1}) == []  # the killed worker's calls died with it
    assert [r.llen(k) for k in r.scan_iter("sandbox:replies:*")] in ([], [0])  # nothing left to deliver twice
    assert r.xlen(Keys().jobs) == 0


def test_client_does_not_hang_when_redis_dies(redis_server):
    async def scenario():
        async with RedisSandbox(redis_server.url, queue_timeout_s=1.5) as sb:
            task = asyncio.create_task(sb.run("print(1)", timeout=1.0))
            await asyncio.sleep(0.3)
            redis_server.stop()
            start = time.monotonic()
            result = await task
            return result, time.monotonic() - start

    result, waited = asyncio.run(scenario())
    assert result.status == "internal" and "no result within" in result.stderr
    assert waited < 6


def test_worker_survives_redis_restart(redis_server):
    worker = start_worker(redis_server.url)
    try:
        redis_server.stop()
        time.sleep(0.5)
        RedisServer(port=redis_server.port).start()

        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
                return await sb.run("print('back')")

        assert asyncio.run(scenario()).stdout == "back\n"
    finally:
        stop(worker)
        subprocess.run(["redis-cli", "-p", str(redis_server.port), "shutdown", "nosave"], capture_output=True)


def test_client_rejects_bad_requests_before_queueing(redis_server):
    async def scenario():
        async with RedisSandbox(redis_server.url) as sb:
            with pytest.raises(ValueError, match="timeout must be in"):
                await sb.run("1", timeout=-1)

    asyncio.run(scenario())
    assert redis.Redis.from_url(redis_server.url).exists(Keys().jobs) == 0


def test_a_job_finished_twice_delivers_one_result(redis_server):
    """Redelivery can run a job twice; only the first result reaches the client."""
    reply_to, deadline = Keys().replies("c1"), time.time() + 60

    async def scenario():
        worker = RedisWorker(redis_server.url, concurrency=1, preload=())
        await worker._finish("1-0", reply_to, deadline, ExecResult("ok", stdout="first\n"))
        await worker._finish("1-0", reply_to, deadline, ExecResult("ok", stdout="second\n"))
        await worker._redis.aclose()

    asyncio.run(scenario())
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert r.llen(Keys().replies("c1")) == 1 and "first" in r.lindex(Keys().replies("c1"), 0)
    assert 0 < r.ttl(Keys().replies("c1")) <= 65  # expires a few seconds after the client's deadline


def test_a_job_that_keeps_killing_its_workers_is_dead_lettered_and_answered(redis_server):
    """A job already delivered max_deliveries times (each worker that took it died: the counter is
    Redis's own, bumped here by claims as a dying worker's successors would) is not run again: it
    goes to the dead-letter list and its client gets an internal result saying so."""
    async def scenario():
        async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
            task = asyncio.create_task(sb.run("print('poison')", timeout=5.0))
            r = redis.Redis.from_url(redis_server.url, decode_responses=True)
            deadline = time.monotonic() + 10
            while not r.xlen(Keys().jobs) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            try:
                r.xgroup_create(Keys().jobs, Keys().group, id="0")
            except redis.ResponseError:
                pass
            [(_, [(entry, _)])] = r.xreadgroup(Keys().group, "doomed", {Keys().jobs: ">"}, count=1)
            for _ in range(3):  # three more deliveries, each to a worker that "died"
                r.xclaim(Keys().jobs, Keys().group, "doomed", min_idle_time=0, message_ids=[entry])
            worker = start_worker(redis_server.url, visibility=0.5)
            try:
                return await task, r, entry
            finally:
                stop(worker)

    result, r, entry = asyncio.run(scenario())
    assert result.status == "internal" and "dead-lettered: delivered 4 times without a result" in result.stderr
    dead = [json.loads(x) for x in r.lrange(Keys().dead, 0, -1)]
    assert [d["entry"] for d in dead] == [entry] and "poison" in dead[0]["fields"]["job"]
    assert r.xlen(Keys().jobs) == 0


def test_a_result_reaches_only_the_client_whose_job_it_is(redis_server):
    """Job ids are Redis's entry ids, not the client's: another client that names this client's
    reply list gets its own job run, and its result is dropped by this client, never taken for
    this client's answer."""
    worker = start_worker(redis_server.url)
    try:
        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as victim:
                mine = asyncio.create_task(victim.run("import time\ntime.sleep(0.8)\nprint('mine')"))
                await asyncio.sleep(0.1)
                forged = json.dumps({"code": "print('forged')", "stdin": "", "timeout": 5.0,
                                     "reply_to": victim.reply_key, "deadline": time.time() + 60})
                redis.Redis.from_url(redis_server.url).xadd(Keys().jobs, {"job": forged})
                return await mine

        result = asyncio.run(scenario())
        assert (result.status, result.stdout) == ("ok", "mine\n")
    finally:
        stop(worker)


def test_a_departed_client_s_queued_jobs_never_run(redis_server, monkeypatch):
    """Calls cancelled while queued (the client went away) are withdrawn: deleted from the stream,
    and marked cancelled for a worker that already took them, before the client's close returns
    (even when it closes at once, and its withdrawals are slow); a worker started later runs none."""
    real_cancel = RedisSandbox._cancel

    async def slow_cancel(self, stream, entry_id):  # a loaded machine (CI left 7 of 10 queued)
        await asyncio.sleep(2.0)
        await real_cancel(self, stream, entry_id)
    monkeypatch.setattr(RedisSandbox, "_cancel", slow_cancel)

    async def scenario():
        async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
            tasks = [asyncio.create_task(sb.run(f"print({i})")) for i in range(10)]
            r = redis.Redis.from_url(redis_server.url)
            deadline = time.monotonic() + 10
            while r.xlen(Keys().jobs) < 10 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return r  # the withdrawals run in the background; closing the client waits for them

    r = asyncio.run(scenario())
    assert r.xlen(Keys().jobs) == 0 and len(list(r.scan_iter("sandbox:cancelled:*"))) == 10
    worker = start_worker(redis_server.url)
    try:
        time.sleep(2)
        assert list(r.scan_iter("sandbox:done:*")) == []  # nothing ran
    finally:
        stop(worker)


def test_many_calls_share_a_bounded_set_of_connections(redis_server):
    """100 calls in flight from one client: one reply listener and a pool of at most
    max_connections, not a connection per call (Redis's own client list, sampled throughout)."""
    worker = start_worker(redis_server.url, concurrency=2)
    try:
        watcher = redis.Redis.from_url(redis_server.url)

        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=60, max_connections=4) as sb:
                peak = 0
                mine = f"sandbox-client-{sb.client_id}"

                async def watch():
                    nonlocal peak
                    while True:
                        peak = max(peak, sum(c["name"] == mine for c in watcher.client_list()))
                        await asyncio.sleep(0.05)

                w = asyncio.create_task(watch())
                results = await asyncio.gather(*(sb.run(f"print({i})") for i in range(100)))
                w.cancel()
                return results, peak

        results, peak = asyncio.run(scenario())
        assert [x.stdout for x in results] == [f"{i}\n" for i in range(100)]
        assert 1 <= peak <= 4, peak
    finally:
        stop(worker)


def test_the_trainer_sandbox_config_builds_a_redis_client_that_reaches_workers(redis_server):
    """sandbox.backend=redis (what the trainer and evaluate build through make_sandbox) sends
    calls to `python -m sandbox worker` processes; a bad URL is refused by the config check."""
    from rstar2_jax.core.config_types import ConfigValueError
    from rstar2_jax.rollout.sandboxes import SandboxConfig, make_sandbox

    with pytest.raises(ConfigValueError, match="url: sandbox.backend=redis needs a redis:// URL"):
        SandboxConfig.from_mapping({"backend": "redis", "redis": {"url": ""}})
    cfg = SandboxConfig.from_mapping({"backend": "redis", "redis": {"url": redis_server.url}})
    worker = start_worker(redis_server.url)
    try:
        async def scenario():
            async with make_sandbox(cfg) as sb:
                assert isinstance(sb, RedisSandbox)
                return await sb.run("print(6 * 7)", timeout=5.0)
        res = asyncio.run(scenario())
        assert res.status == "ok" and res.stdout == "42\n"
    finally:
        stop(worker)


def test_a_call_in_flight_when_redis_restarts_empty_is_queued_again_and_answered_once(redis_server):
    """Redis restarted without persistence loses the queue: a call waiting in it would never be
    answered. The client notices its job is gone (no entry, no result) once it reconnects, queues
    it again, and gets exactly one result."""
    worker = None
    restarted = []
    try:
        async def scenario():
            nonlocal worker
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
                task = asyncio.create_task(sb.run("print('once')", timeout=5.0))
                await asyncio.sleep(0.5)  # queued; no worker yet
                redis_server.stop()
                await asyncio.sleep(0.5)
                restarted.append(RedisServer(port=redis_server.port).start())
                worker = start_worker(redis_server.url)
                return await task

        start = time.monotonic()
        result = asyncio.run(scenario())
        assert (result.status, result.stdout) == ("ok", "once\n") and time.monotonic() - start < 30
        r = redis.Redis.from_url(redis_server.url)
        assert r.xlen(Keys().jobs) == 0 and [r.llen(k) for k in r.scan_iter("sandbox:replies:*")] in ([], [0])
    finally:
        if worker is not None:
            stop(worker)
        for server in restarted:  # the fixture stops only the first one
            server.stop()


def test_sessions_over_redis_stay_on_their_worker_and_survive_its_death_with_a_note(redis_server):
    """Two real workers: a session's cells all run where it was opened (its variables persist); when
    that worker is SIGKILLed the next cell opens a fresh session on the other and says why."""
    workers = [start_worker(redis_server.url, concurrency=1, visibility=1.5) for _ in range(2)]
    try:
        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
                async with await sb.session() as s, await sb.session() as t:
                    first = [await s.run("x = 20"), await s.run("x += 1\nprint(x * 2)"),
                             await t.run("print('x' in globals())")]
                    home = s.stream
                    victim = next(p for p in workers if home.endswith(f"-{p.pid}"))
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    start = time.monotonic()
                    lost = await s.run("print('x' in globals())")
                    waited = time.monotonic() - start
                    again = [await s.run("y = 3"), await s.run("print(y)")]
                    return first, lost, waited, again, s.stream != home, s.restarts

        first, lost, waited, again, moved, restarts = asyncio.run(scenario())
        assert [r.status for r in first] == ["ok", "ok", "ok"]
        assert first[1].stdout == "42\n" and first[2].stdout == "False\n"  # sessions do not share state
        assert lost.status == "ok" and lost.stdout == "False\n" and "lost this session" in lost.stderr
        assert waited < 10  # noticed by the worker's expired alive key, not the 30 s queue timeout
        assert again[1].stdout == "3\n" and moved and restarts == 1
    finally:
        for w in workers:
            stop(w)


def test_a_session_cell_for_an_unknown_id_is_answered_as_lost(redis_server):
    async def scenario():
        worker = RedisWorker(redis_server.url, concurrency=1, preload=())
        serving = asyncio.create_task(worker.serve())
        try:
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
                s = await sb.session()
                forged = await sb._call(s.stream, {"op": "session_run", "session": "guessed", "code": "1"}, 5.0)
                closed = [await s.run("z = 1"), await s.close()]
                return forged, closed
        finally:
            worker.stop()
            await serving

    forged, closed = asyncio.run(scenario())
    assert forged["session_lost"] and forged["result"]["status"] == "internal"
    assert closed[0].status == "ok"


def test_a_departed_client_s_running_call_is_killed_and_its_slot_freed(redis_server):
    """A client that goes away while its call runs: the worker kills the call within a second or
    so and takes the next job (one slot: a 30 s call left running would hold it)."""
    worker = start_worker(redis_server.url, concurrency=1)
    try:
        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=60) as sb:
                long = asyncio.create_task(sb.run("import time\nprint('started', flush=True)\ntime.sleep(30)",
                                                  timeout=40))
                r = redis.Redis.from_url(redis_server.url)
                deadline = time.monotonic() + 20
                while not _pending(r) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)  # taken by the worker
                await asyncio.sleep(1.0)  # and running
                long.cancel()
                await asyncio.gather(long, return_exceptions=True)
                start = time.monotonic()
                after = await sb.run("print('next')", timeout=5)
                return after, time.monotonic() - start

        after, waited = asyncio.run(scenario())
        assert after.stdout == "next\n"
        assert waited < 8  # not the 29 s the abandoned call had left
    finally:
        stop(worker)


def test_no_entry_on_the_stream_can_take_down_a_worker(redis_server):
    """A corpus of malformed entries (every way of tests/sandbox/test_jobs.py, as raw bytes on the
    stream, non-UTF-8 included) beside well-formed calls from a real client, two workers: every
    call is answered correctly, both workers are alive at the end, and every malformed entry is in
    the dead-letter list with its reason (and off the stream)."""
    from tests.sandbox.test_jobs import MALFORMED
    workers = [start_worker(redis_server.url), start_worker(redis_server.url)]
    raw = redis.Redis.from_url(redis_server.url)  # bytes in, bytes out
    try:
        async def scenario():
            async with RedisSandbox(redis_server.url, queue_timeout_s=30) as sb:
                calls = [asyncio.create_task(sb.run(f"print({i} * {i})", timeout=5.0)) for i in range(8)]
                bad = []
                for fields, _ in MALFORMED:
                    encoded = {k: v.encode("utf-8", "surrogateescape") for k, v in fields.items()}
                    bad.append(raw.xadd(Keys().jobs, encoded).decode())
                bad.append(raw.xadd(Keys().jobs, {b"job": b"\xff\xfe{not utf-8"}).decode())
                return await asyncio.gather(*calls), bad

        results, bad = asyncio.run(scenario())
        assert [(r.status, r.stdout) for r in results] == [("ok", f"{i * i}\n") for i in range(8)]
        deadline = time.monotonic() + 20
        while raw.llen(Keys().dead) < len(bad) and time.monotonic() < deadline:
            time.sleep(0.1)
        dead = {d["entry"]: d for d in map(json.loads, raw.lrange(Keys().dead, 0, -1))}
        assert sorted(dead) == sorted(bad)
        for (_fields, words), entry in zip(MALFORMED, bad):
            assert words.split()[0] in dead[entry]["reason"], (words, dead[entry]["reason"])
        assert "not UTF-8" in dead[bad[-1]]["reason"]
        assert raw.xlen(Keys().jobs) == 0  # acknowledged and deleted, nothing left to redeliver
        assert all(w.poll() is None for w in workers)
    finally:
        for w in workers:
            stop(w)
