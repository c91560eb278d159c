"""Several trainer processes on this machine: jax.distributed over a loopback coordinator, one
CPU device each, gloo collectives."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable

from rstar2_jax.rollout.engines.vllm_engine.server import free_port
from tests.xla_flags import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(args: list[str], log_prefix, n: int = 2, timeout: float = 600, kill_when: Callable[[], bool] | None = None,
           kill: int = 1, devices_per_process: int = 1) -> list[tuple[int, str, str]]:
    """Run `args` (a `python -m rstar2_jax.train ...` command) as n processes of one job; returns
    (exit status, stdout, stderr) of each. Output goes to files, not pipes: a process blocked on a
    full pipe nobody reads yet would stall the others in a collective. `devices_per_process`: fake
    CPU devices each. With `kill_when`, process
    `kill` gets SIGKILL as soon as kill_when() holds (polled every 50 ms)."""
    port = free_port()
    args = args + ["--config.distributed=True", f"--coordinator=127.0.0.1:{port}", f"--num_processes={n}"]
    many = (f"--xla_force_host_platform_device_count={devices_per_process}",) if devices_per_process > 1 else ()
    env = {**os.environ, "XLA_FLAGS": xla_flags(*many)}  # one CPU device per process, unless told
    logs = [(open(f"{log_prefix}.p{i}.out", "w+"), open(f"{log_prefix}.p{i}.err", "w+")) for i in range(n)]
    procs = [subprocess.Popen(args + [f"--process_id={i}"], cwd=ROOT, env=env, stdout=out, stderr=err)
             for i, (out, err) in enumerate(logs)]
    try:
        if kill_when is not None:
            deadline = time.monotonic() + timeout
            while not kill_when() and time.monotonic() < deadline and procs[kill].poll() is None:
                time.sleep(0.05)
            procs[kill].send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, logs):
        with out, err:
            out.seek(0)
            err.seek(0)
            results.append((p.returncode, out.read(), err.read()))
    return results
