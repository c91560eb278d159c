"""`python -m sandbox bench`: throughput and latency percentiles of LocalSandbox.

Workloads: a trivial snippet, a sympy snippet, and a mixed realistic set (math tool calls as a
policy writes them). Each is also run through a fresh-interpreter-per-call baseline (what
code-judge does: `python3 source.py` per call) at the same concurrency, and the ratio reported.
`--burst N` submits N calls at once (the paper's 45,000 per step) and checks that every call got
exactly one correct result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from sandbox.local import ISOLATION_MODES, LocalSandbox

WORKLOADS = {
    "trivial": ["print(1 + 1)"],
    "sympy": ["import sympy\nx = sympy.Symbol('x')\nprint(sympy.factor(x**4 - 1))"],
    "mixed": [
        "print(sum(i * i for i in range(1000)))",
        "import math\nprint(math.comb(30, 12) % 1000)",
        "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 30)))",
        "import sympy\nx = sympy.Symbol('x')\nprint(sympy.solve(x**3 - 6*x**2 + 11*x - 6, x))",
        "import numpy as np\na = np.arange(1, 101)\nprint(int((a ** 2).sum()))",
        "import itertools\nprint(sum(1 for p in itertools.permutations(range(7)) if p[0] < p[-1]))",
        "n = int(input())\nprint(n * (n + 1) // 2)",
        "import sympy\nprint(sympy.isprime(2**61 - 1), sympy.factorint(360))",
        "x = [1, 2, 3]\nx[5]",  # an error, as policies write them
    ],
}


def add_args(p: argparse.ArgumentParser):
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16, help="calls in flight")
    p.add_argument("--calls", type=int, default=600, help="calls per workload")
    p.add_argument("--baseline-calls", type=int, default=60, help="calls per workload for the fresh-interpreter baseline")
    p.add_argument("--workloads", default="trivial,sympy,mixed", help="comma list, or 'none' (burst only)")
    p.add_argument("--burst", type=int, default=0, help="also submit this many calls at once (e.g. 45000)")
    p.add_argument("--isolation", choices=ISOLATION_MODES, default="strict")
    p.add_argument("--json", help="write the results to this file too")


def _percentiles(latencies):
    s = sorted(latencies)
    return {f"p{q}": s[min(len(s) - 1, int(len(s) * q / 100))] * 1000 for q in (50, 90, 99)}


async def _measure(run_one, codes, calls, concurrency):
    """run_one(code) -> (status, seconds the call itself took inside the executor or None)."""
    latencies, exec_times = [], []
    statuses = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(i):
        async with sem:
            start = time.perf_counter()
            status, exec_s = await run_one(codes[i % len(codes)])
            latencies.append(time.perf_counter() - start)
            if exec_s is not None:
                exec_times.append(exec_s)
            statuses[status] = statuses.get(status, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(calls)))
    wall = time.perf_counter() - start
    out = {"calls": calls, "calls_per_s": calls / wall, **_percentiles(latencies), "statuses": statuses}
    if exec_times:  # the call alone, without waiting for a free worker
        out.update({f"exec_{k}": v for k, v in _percentiles(exec_times).items()})
    return out


async def _fresh_interpreter(code: str, workdir: str) -> str:
    """The baseline: a new `python3 file.py` per call, as the reference service runs code."""
    path = os.path.join(workdir, f"src_{os.getpid()}_{time.perf_counter_ns()}.py")
    with open(path, "w") as f:
        f.write(code)
    proc = await asyncio.create_subprocess_exec(sys.executable, path, stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    await asyncio.wait_for(proc.communicate(b"10\n"), 30)
    os.remove(path)
    return ("ok" if proc.returncode == 0 else "error"), None


async def _burst(sb: LocalSandbox, n: int):
    start = time.perf_counter()
    results = await sb.run_many([{"code": f"print({i} * 7)", "timeout": 10} for i in range(n)])
    wall = time.perf_counter() - start
    wrong = [i for i, r in enumerate(results) if r.stdout != f"{i * 7}\n"]
    return {"calls": n, "seconds": wall, "calls_per_s": n / wall, "results": len(results), "wrong_or_lost": len(wrong)}


async def run_bench(args) -> dict:
    report = {"workers": args.workers, "concurrency": args.concurrency, "cpus": os.cpu_count(),
              "isolation": args.isolation, "workloads": {}}
    async with LocalSandbox(workers=args.workers, isolation=args.isolation, max_pending=1 << 20) as sb:
        await sb.run_many([{"code": "print(1)"}] * (args.workers * 4))  # warm up
        with tempfile.TemporaryDirectory() as workdir:
            for name in [w for w in args.workloads.split(",") if w and w != "none"]:
                codes = WORKLOADS[name]

                async def sandboxed(code):
                    r = await sb.run(code, stdin="10\n", timeout=30)
                    return r.status, r.duration_s

                ours = await _measure(sandboxed, codes, args.calls, args.concurrency)
                base = await _measure(lambda c: _fresh_interpreter(c, workdir), codes, args.baseline_calls,
                                      args.concurrency)
                report["workloads"][name] = {"sandbox": ours, "fresh_interpreter": base,
                                             "throughput_ratio": ours["calls_per_s"] / base["calls_per_s"]}
                print(f"{name:8s} sandbox {ours['calls_per_s']:7.0f} calls/s  p50 {ours['p50']:6.1f} ms  "
                      f"p99 {ours['p99']:6.1f} ms  (call alone p50 {ours['exec_p50']:5.1f} ms) | "
                      f"fresh interpreter {base['calls_per_s']:6.1f} calls/s  "
                      f"p50 {base['p50']:7.1f} ms | x{report['workloads'][name]['throughput_ratio']:.1f}", flush=True)
        if args.burst:
            report["burst"] = await _burst(sb, args.burst)
            b = report["burst"]
            print(f"burst    {b['calls']} calls in {b['seconds']:.1f} s ({b['calls_per_s']:.0f} calls/s), "
                  f"{b['results']} results, {b['wrong_or_lost']} wrong or lost", flush=True)
    return report


def write_json(path: str | None, report: dict):
    """Save a benchmark's report (nothing without a path), creating its directory."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def main(args):
    report = asyncio.run(run_bench(args))
    write_json(args.json, report)
    return report
