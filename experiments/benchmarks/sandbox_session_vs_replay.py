"""Per-call cost of a stateful tool: sandbox sessions vs replaying earlier cells (the release).

rStar2-Agent's release simulates a Jupyter tool by prepending every earlier cell of the
trajectory to each new call, so call t re-runs t cells. A session (sandbox.Session) keeps the
interpreter alive and runs only the new cell. Both run here on the same LocalSandbox, turn by
turn, for a 20-turn trajectory of typical math cells (sympy, fractions, loops).

    python -m experiments.benchmarks.sandbox_session_vs_replay --json runs/bench/session_vs_replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import sandbox
from sandbox.bench import write_json

CELLS = [
    "import sympy as sp\nx = sp.Symbol('x')\nroots = sp.solve(x**2 - 5*x + 6, x)\nprint(roots)",
    "from fractions import Fraction\ntotal = sum(Fraction(1, k * (k + 1)) for k in range(1, 200))\nprint(total)",
    "count = sum(1 for n in range(1, 20000) if n % 3 == 0 or n % 5 == 0)\nprint(count)",
    "poly = sp.expand((x + 1)**8)\nprint(poly.coeff(x, 4))",
    "import math\nprint(math.comb(40, 20) % 1000, roots)",
]


def cell(turn: int) -> str:
    return CELLS[turn % len(CELLS)]


async def trajectory(sb, turns: int) -> dict:
    """Latency (ms) of each turn's call, both ways."""
    replay, session = [], []
    async with await sb.session() as s:
        for t in range(turns):
            start = time.perf_counter()
            r = await sb.run("\n".join(cell(i) for i in range(t + 1)), timeout=60)  # the release's replay
            replay.append((time.perf_counter() - start) * 1e3)
            assert r.ok, r
            start = time.perf_counter()
            r = await s.run(cell(t), timeout=60)
            session.append((time.perf_counter() - start) * 1e3)
            assert r.ok, r
    return {"replay": replay, "session": session}


async def run(args) -> dict:
    async with sandbox.LocalSandbox(workers=2) as sb:
        await trajectory(sb, 2)  # warm-up
        runs = [await trajectory(sb, args.turns) for _ in range(args.repeats)]
    report = {"turns": args.turns, "repeats": args.repeats, "cpus": os.cpu_count(), "per_turn_ms": {}}
    for mode in ("replay", "session"):
        report["per_turn_ms"][mode] = [statistics.median(r[mode][t] for r in runs) for t in range(args.turns)]
    for t in sorted({0, 4, 9, args.turns - 1}):
        print(f"turn {t + 1:3d}: replay {report['per_turn_ms']['replay'][t]:8.1f} ms | session "
              f"{report['per_turn_ms']['session'][t]:6.1f} ms", flush=True)
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
