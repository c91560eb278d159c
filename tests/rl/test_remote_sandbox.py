"""Training with the code sandbox on other processes, as on other hosts: `sandbox.backend=redis`
(a redis-server and `python -m sandbox worker`s, started here) and `sandbox.backend=http` (a
`python -m sandbox serve`). Both must train exactly as the local sandbox does for the same seed:
the same rollouts, tool outputs, rewards and updates; over Redis also while a worker is
SIGKILLed mid-step and Redis restarts empty (no tool call lost, none answered twice), and when
the trainer itself is SIGKILLed mid-trajectory and started again (its in-flight rollouts resumed
from the journal, rollout/journal.py, not restarted)."""

import glob
import os

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import redis as redis_lib

from rstar2_jax.rl.trainer import run
from rstar2_jax.rollout.engines.vllm_engine.server import free_port
from rstar2_jax.traces import read_traces
from tests.rl.test_multiprocess import params
from tests.rl.test_training import COMPARED, ROOT, rl_lines, small_config
from tests.sandbox.helpers import prometheus_total
from tests.sandbox.redis_server import RedisServer
from tests.sandbox.test_redis import stop


def start(args: list[str], ready: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    while not any(ready in line for line in lines):  # log lines may come first
        lines.append(proc.stdout.readline())
        assert lines[-1] and len(lines) < 20, lines
    return proc


def trained(workdir, model: str, backend: str = "local", url: str = ""):
    cfg = small_config(steps=2)
    cfg.eval.before_and_after = False
    cfg.model.path, cfg.sft.steps = model, 0
    cfg.sandbox.backend = backend
    if url:
        getattr(cfg.sandbox, backend).url = url
    run(cfg, str(workdir))
    traces = read_traces(workdir / "traces").sort_values(["step", "problem_id", "sample_index"])
    columns = ["token_ids", "loss_mask", "logprobs", "reward", "p_err", "kept", "advantage", "num_tool_calls"]
    rows = [tuple(tuple(v) if hasattr(v, "__len__") and not isinstance(v, str) else v for v in r)
            for r in traces[columns].itertuples(index=False)]
    outputs = [[(t["status"], t["output"]) for turn in turns for t in turn["tools"]] for turns in traces["turns"]]
    return rows, outputs, rl_lines(workdir)


# The same run as `trained(..., "redis", url)`, as a `python -m rstar2_jax.train` process to SIGKILL.
KILLED_CONFIG = """
from tests.rl.test_training import small_config


def get_config():
    c = small_config(steps=2)
    c.eval.before_and_after = False
    c.sft.steps = 0
    return c
"""


def mid_trajectory(workdir) -> bool:
    """A rollout of some step saved at a turn boundary and not finished (the kill lands mid-trajectory)."""
    for path in glob.glob(os.path.join(workdir, "inflight", "step*", "r*.jsonl")):
        try:
            with open(path) as f:
                lines = [json.loads(line) for line in f.read().splitlines()]
        except (OSError, ValueError):  # being written
            continue
        if len(lines) >= 2 and not lines[-1].get("finished"):  # header + a turn boundary, not done
            return True
    return False


def killed_mid_trajectory(tmp_path, workdir, model: str, url: str) -> bool:
    """Starts the run as a process over Redis and SIGKILLs it once a rollout is mid-trajectory;
    whether the kill landed before the run ended."""
    config = tmp_path / "killed_config.py"
    config.write_text(KILLED_CONFIG)
    proc = subprocess.Popen([sys.executable, "-m", "rstar2_jax.train", f"--config={config}", f"--workdir={workdir}",
                             f"--config.model.path={model}", "--config.sandbox.backend=redis",
                             f"--config.sandbox.redis.url={url}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not mid_trajectory(workdir):
        time.sleep(0.02)
    landed = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return landed


class WorkerKiller(threading.Thread):
    """SIGKILLs the local sandbox's worker (the zygote's child supervising calls) that runs the first
    tool call it sees, `times` times, during training in this process."""

    def __init__(self, times: int = 1):
        super().__init__(daemon=True)
        self.times, self.killed = times, 0
        self.stop_event = threading.Event()

    def run(self):
        from sandbox.pool import child_pids, running_calls
        while not self.stop_event.is_set() and self.killed < self.times:
            for zygote in child_pids(os.getpid()):
                for worker in child_pids(zygote):
                    if running_calls(worker) and self.killed < self.times:
                        os.kill(worker, signal.SIGKILL)
                        self.killed += 1
                        time.sleep(0.3)  # the next kill: another call
            time.sleep(0.0005)  # a call lasts a few ms: poll often enough to catch one


class Faults(threading.Thread):
    """SIGKILLs `victim` once a tool call has been queued, then restarts Redis (empty) once two
    more have: both mid-step, whatever the timing of the run."""

    def __init__(self, redis, victim):
        super().__init__(daemon=True)
        self.redis, self.victim, self.done = redis, victim, []
        self.stop_event = threading.Event()

    def queued(self) -> int:
        try:
            return redis_lib.Redis.from_url(self.redis.url).xinfo_stream("sandbox:jobs")["entries-added"]
        except redis_lib.RedisError:
            return 0

    def run(self):
        while not self.stop_event.is_set() and len(self.done) < 2:
            n = self.queued()
            if not self.done and n >= 1:
                self.victim.send_signal(signal.SIGKILL)
                self.done.append(("worker killed", n))
            elif len(self.done) == 1 and n >= 3:
                self.redis.stop()
                time.sleep(0.5)
                self.redis.start()
                self.done.append(("redis restarted", n))
            time.sleep(0.02)


@pytest.mark.slow
def test_training_over_redis_workers_and_an_http_service_equals_the_local_sandbox(tmp_path, seed0_warm_start):
    # a policy SFT'd long enough that most of its tool calls parse and run (a barely trained one
    # makes malformed calls that never reach a sandbox): the session's, shared with the ablations
    model = os.path.join(seed0_warm_start[1], "model")
    local = trained(tmp_path / "local", model)
    calls = sum(status != "parse_error" for o in local[1] for status, _ in o)  # the ones that reach a sandbox
    assert calls >= 4, "the policy made too few tool calls for the comparison to mean anything"
    # the local sandbox's worker SIGKILLed under a call mid-step: the call is run again (retries=1
    # in the traces), so training, p_err included, is the undisturbed run's
    killer = WorkerKiller(times=1)
    killer.start()
    try:
        worker_killed = trained(tmp_path / "worker_killed", model)
    finally:
        killer.stop_event.set()
        killer.join()
    retried = [t["retries"] for turns in read_traces(tmp_path / "worker_killed" / "traces")["turns"]
               for turn in turns for t in turn["tools"]]
    assert killer.killed == 1 and sum(retried) == 1
    assert worker_killed[0] == local[0] and worker_killed[1] == local[1]

    redis = RedisServer().start()
    worker = start(["worker", "--redis", redis.url, "--concurrency", "2"], "sandbox worker")
    port = free_port()
    service = start(["serve", "--port", str(port), "--workers", "2"], "sandbox serving on")
    try:
        over_redis = trained(tmp_path / "redis", model, "redis", redis.url)
        over_http = trained(tmp_path / "http", model, "http", f"http://127.0.0.1:{port}")
        queued = redis_lib.Redis.from_url(redis.url).xinfo_stream("sandbox:jobs")["entries-added"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            served = int(prometheus_total(resp.read().decode(), "sandbox_results_total"))
        # faults mid-step: one of two workers SIGKILLed (its calls redelivered after the
        # visibility timeout), then Redis restarted without persistence (queued calls re-sent)
        victim = start(["worker", "--redis", redis.url, "--concurrency", "2", "--visibility-timeout", "1.5"],
                       "sandbox worker")
        faults = Faults(redis, victim)
        faults.start()
        try:
            with_faults = trained(tmp_path / "faults", model, "redis", redis.url)
        finally:
            faults.stop_event.set()
            faults.join()
            stop(victim)
        # the trainer SIGKILLed mid-trajectory, then started again on the same directory
        assert killed_mid_trajectory(tmp_path, tmp_path / "killed", model, redis.url)
        resumed = trained(tmp_path / "killed", model, "redis", redis.url)
    finally:
        stop(service)
        stop(worker)
        redis.stop()
    assert [what for what, _ in faults.done] == ["worker killed", "redis restarted"]
    assert queued == calls and served == calls  # every tool call went to the remote workers, once
    assert with_faults[1] == local[1] and with_faults[0] == local[0]  # no call lost, none doubled
    for name, remote in (("redis", over_redis), ("http", over_http)):
        assert remote[0] == local[0], name  # tokens, rewards, RoC and advantages of every rollout
        assert remote[1] == local[1], name  # every tool output
        for a, b in zip(local[2], remote[2]):
            for key in COMPARED:
                if key in a:
                    assert a[key] == b[key], (name, a["step"], key)
    assert json.loads((tmp_path / "redis" / "config.json").read_text())["sandbox"]["backend"] == "redis"
    # the killed run's in-flight rollouts continued where they were, and it ends as the
    # uninterrupted run, bit for bit: every rollout, tool output and update, and the weights
    assert sum(l.get("inflight/resumed_partial", 0) for l in resumed[2]) >= 1
    assert resumed[0] == local[0] and resumed[1] == local[1]
    for a, b in zip(local[2], resumed[2]):
        for key in COMPARED:
            if key in a:
                assert a[key] == b[key], ("resumed", a["step"], key)
    for x, y in zip(params(tmp_path / "local"), params(tmp_path / "killed")):
        np.testing.assert_array_equal(y, x)
    assert not os.listdir(tmp_path / "killed" / "inflight")  # every trained step's journal pruned
