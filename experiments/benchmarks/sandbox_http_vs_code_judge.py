"""Our sandbox over HTTP vs code-judge (the service rStar2-Agent uses), side by side, one machine.

Both are driven through the same client and the same code-judge request body
(POST /run {"type": "python", "solution", "input"}), by N concurrent clients with keep-alive,
each server with 2 execution slots. Servers take turns per workload and round (noise on a
shared machine hits both alike); the figure is completed requests per second.

code-judge is not a dependency of this repo: fetch it and give it a venv (its requirements plus
numpy and sympy, which the submitted code imports), then

    python -m experiments.benchmarks.sandbox_http_vs_code_judge \\
        --code-judge-dir /tmp/cj --code-judge-python /tmp/cj/venv/bin/python --json runs/bench/http_vs_cj.json

Ours runs with everything on (strict isolation, per-call cgroups, seccomp, minimal root).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import aiohttp

from rstar2_jax.rollout.engines.vllm_engine.server import free_port
from sandbox.bench import WORKLOADS, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_WORKLOADS = {
    "trivial": WORKLOADS["trivial"],
    "sympy": WORKLOADS["sympy"],
    "numpy": ["import numpy as np\nprint(int(np.linalg.matrix_rank(np.arange(16).reshape(4, 4))))"],
    "mixed": WORKLOADS["mixed"],
}


def wait_http(url: str, timeout_s: float = 120.0):
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up in {timeout_s} s")


class Servers:
    """redis + code-judge (API and 2 workers) + ours, each in its own process group."""

    def __init__(self, args):
        self.procs = []
        self.logs = open(os.path.join(args.log_dir, "servers.log"), "w")
        redis_port, self.cj_port, self.our_port = free_port(), free_port(), free_port()
        self._start(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"])
        env = {"PATH": os.environ["PATH"], "REDIS_URI": f"redis://127.0.0.1:{redis_port}",
               "MAX_WORKERS": str(args.slots), "PYTHON_EXECUTOR_PATH": args.code_judge_python,
               "MAX_EXECUTION_TIME": "10"}
        self._start([args.code_judge_python, "-m", "uvicorn", "app.main:app", "--port", str(self.cj_port),
                     "--workers", "1", "--log-level", "warning"], cwd=args.code_judge_dir, env=env)
        self._start([args.code_judge_python, "run_workers.py"], cwd=args.code_judge_dir, env=env)
        self._start([sys.executable, "-m", "sandbox", "serve", "--port", str(self.our_port), "--workers",
                     str(args.slots)], cwd=ROOT)
        wait_http(f"http://127.0.0.1:{self.cj_port}/ping")
        wait_http(f"http://127.0.0.1:{self.our_port}/ping")

    def _start(self, cmd, **kw):
        self.procs.append(subprocess.Popen(cmd, stdout=self.logs, stderr=subprocess.STDOUT, start_new_session=True, **kw))

    def close(self):
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


async def load(url: str, codes: list[str], *, clients: int, max_requests: int, max_seconds: float) -> dict:
    """`clients` concurrent keep-alive clients posting code-judge submissions round-robin."""
    counter = iter(range(max_requests))
    latencies, outcomes = [], {}
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        start = time.perf_counter()

        async def client():
            for i in counter:
                if time.perf_counter() - start > max_seconds:
                    return
                body = {"type": "python", "solution": codes[i % len(codes)], "input": "10\n"}
                t = time.perf_counter()
                async with http.post(url + "/run", json=body) as resp:
                    out = await resp.json()
                latencies.append(time.perf_counter() - t)
                key = "run_success" if out.get("run_success") else (out.get("reason") or "error")
                outcomes[key] = outcomes.get(key, 0) + 1

        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    lat = sorted(latencies)
    return {"requests": len(lat), "seconds": wall, "req_per_s": len(lat) / wall,
            "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
            "outcomes": outcomes}


async def run(args, servers: Servers) -> dict:
    urls = {"code-judge": f"http://127.0.0.1:{servers.cj_port}", "ours": f"http://127.0.0.1:{servers.our_port}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(urls["ours"] + "/health") as resp:
            protections = (await resp.json())["protections"]
    report = {"clients": args.clients, "slots": args.slots, "cpus": os.cpu_count(), "ours_protections": protections,
              "workloads": {}}
    for name in args.workloads.split(","):
        codes = BENCH_WORKLOADS[name]
        for server in urls:  # warm-up: imports, caches, connection set-up
            await load(urls[server], codes, clients=args.clients, max_requests=4 * args.clients, max_seconds=30)
        rounds = {server: [] for server in urls}
        for _ in range(args.rounds):
            for server, url in urls.items():
                rounds[server].append(await load(url, codes, clients=args.clients, max_requests=args.requests,
                                                 max_seconds=args.seconds))
        entry = {server: {"req_per_s": statistics.median(r["req_per_s"] for r in rs), "rounds": rs}
                 for server, rs in rounds.items()}
        entry["ratio"] = entry["ours"]["req_per_s"] / entry["code-judge"]["req_per_s"]
        report["workloads"][name] = entry
        print(f"{name:8s} code-judge {entry['code-judge']['req_per_s']:7.1f} req/s | ours {entry['ours']['req_per_s']:7.1f} "
              f"req/s | x{entry['ratio']:.1f}   (outcomes: code-judge {rounds['code-judge'][-1]['outcomes']}, "
              f"ours {rounds['ours'][-1]['outcomes']})", flush=True)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code-judge-dir", required=True)
    p.add_argument("--code-judge-python", required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--requests", type=int, default=2000, help="per server, workload and round (at most)")
    p.add_argument("--seconds", type=float, default=15.0, help="per server, workload and round (at most)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="trivial,sympy,numpy,mixed")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json")
    args = p.parse_args(argv)
    servers = Servers(args)
    try:
        report = asyncio.run(run(args, servers))
    finally:
        servers.close()
    write_json(args.json, report)


if __name__ == "__main__":
    main()
