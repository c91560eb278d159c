"""The job's secret (issue 48, item 4): the header check, the refusal to listen openly, and Redis
with a password given as the SLURM launcher gives it (stdin), against a real redis-server: a
client or worker without the secret is refused at once (not retried as a restart), with it the
call runs."""

import asyncio
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.job_secret import (SECRET_ENV, OpenServiceError, authorised, bearer_headers, check_open_service,
                                is_loopback)
from sandbox.redis_queue.client import RedisSandbox
from sandbox.redis_queue.protocol import RedisRefused
from sandbox.redis_queue.worker import RedisWorker
from tests.sandbox.redis_server import RedisServer
from tests.sandbox.test_redis import ROOT

SECRETS = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64)


@given(SECRETS, SECRETS)
def test_only_the_secret_itself_is_authorised(secret, other):
    assert authorised(bearer_headers(secret)["Authorization"], secret)
    assert authorised(f"Bearer {other}", secret) == (other == secret)
    assert not authorised(None, secret) and not authorised(secret, secret)  # the scheme is part of it
    assert authorised(None, None) and authorised("anything", None)  # nothing to check: open
    assert bearer_headers(None) == {}


def test_a_service_refuses_to_listen_beyond_loopback_without_a_secret_and_warns_on_loopback():
    for host in ("0.0.0.0", "10.1.2.3", "node17"):
        with pytest.raises(OpenServiceError, match=f"refusing to listen on '{host}' without a secret.*{SECRET_ENV}"):
            check_open_service("the thing", host, None)
        check_open_service("the thing", host, "s3cret")  # with one: no error, no warning
    said = []
    for host in ("127.0.0.1", "localhost", "::1"):
        assert is_loopback(host)
        check_open_service("the thing", host, None, warn=said.append)
    assert len(said) == 3 and all("WARNING: the thing on" in s and "every user of this machine" in s for s in said)


@pytest.fixture
def locked_redis():
    server = RedisServer(password="job-s3cret").start()
    yield server
    server.stop()


def test_redis_with_the_job_secret_serves_its_holders_and_refuses_everyone_else(locked_redis, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)

    async def call():
        async with RedisSandbox(locked_redis.url, queue_timeout_s=30) as sb:
            return await sb.run("print(6 * 7)")

    with pytest.raises(RedisRefused, match=f"refused this client.*{SECRET_ENV}"):  # at once, not at the deadline
        asyncio.run(asyncio.wait_for(call(), 10))
    monkeypatch.setenv(SECRET_ENV, "wrong")
    with pytest.raises(RedisRefused):
        asyncio.run(asyncio.wait_for(call(), 10))
    worker = RedisWorker(locked_redis.url, concurrency=1, preload=())
    with pytest.raises(RedisRefused):
        asyncio.run(asyncio.wait_for(worker.serve(), 30))

    monkeypatch.setenv(SECRET_ENV, "job-s3cret")
    worker = RedisWorker(locked_redis.url, concurrency=1, preload=())

    async def served():
        task = asyncio.create_task(worker.serve())
        try:
            return await call()
        finally:
            worker.stop()
            await task

    assert asyncio.run(asyncio.wait_for(served(), 60)).stdout == "42\n"


def test_the_worker_command_without_the_secret_exits_saying_why(locked_redis):
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run([sys.executable, "-m", "sandbox", "worker", "--redis", locked_redis.url, "--concurrency", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "refused this client" in done.stderr and SECRET_ENV in done.stderr, done.stderr


def test_the_http_sandbox_takes_the_job_secret_from_the_environment(monkeypatch):
    """`python -m sandbox serve` with $RSTAR2_SECRET refuses requests without it and serves an
    HTTPSandbox client that finds it in its own environment; beyond loopback without it, it
    refuses to start."""
    import signal
    import urllib.error
    import urllib.request

    from sandbox.http_service.client import HTTPSandbox
    from tests.sandbox.redis_server import free_port

    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, "SANDBOX_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "sandbox", "serve", "--host", "0.0.0.0", "--port", str(free_port()),
                           "--workers", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "refusing to listen on '0.0.0.0' without a secret" in done.stderr, done.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "serve", "--port", str(port), "--workers", "1"],
                            cwd=ROOT, env={**env, SECRET_ENV: "job-s3cret"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("sandbox serving on" in line for line in lines):
            lines.append(proc.stdout.readline())
            assert lines[-1] and len(lines) < 20, lines
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=30)
        assert refused.value.code == 401

        async def call():
            async with HTTPSandbox(f"http://127.0.0.1:{port}") as sb:
                return await sb.run("print(6 * 7)")

        monkeypatch.setenv(SECRET_ENV, "job-s3cret")
        assert asyncio.run(call()).stdout == "42\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
