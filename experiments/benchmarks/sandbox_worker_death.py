"""What a dying sandbox worker costs: the killed call's answer time, the slot's recovery time, and
throughput under a kill loop against the same load without one (issue 28).

A LocalSandbox with every protection on serves `--clients` concurrent callers of short calls
(`--seconds` each phase). Phase 1: no faults. Phase 2: every `--kill-every-s` a worker that is
running a call is SIGKILLed (what the kernel's OOM killer does). Measured:
- answer: from the kill to the killed call's result (status worker_died);
- recovery: from the kill until the master has started the slot's new worker;
- capacity: calls/s of phase 2 over phase 1; and after phase 2 all slots run side by side.

    python -m experiments.benchmarks.sandbox_worker_death --record BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import threading
import time

import sandbox
from experiments.benchmarks.common import SANDBOX, record
from sandbox.pool import child_pids, running_calls

CALL = "import time\ntime.sleep(0.02)\nprint(sum(range(100)))"


class KillLoop(threading.Thread):
    """Every `every_s`: SIGKILL a worker (a child of the master) that has a call running, then time
    until a new worker appears among the master's children."""

    def __init__(self, zygote_pid: int, every_s: float):
        super().__init__(daemon=True)
        self.zygote, self.every_s = zygote_pid, every_s
        self.kills: list[float] = []       # monotonic time of each kill
        self.recoveries: list[float] = []  # seconds until the replacement worker existed
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(self.every_s):
            before = set(child_pids(self.zygote))
            busy = [w for w in before if running_calls(w)]
            if not busy:
                continue
            os.kill(busy[0], signal.SIGKILL)
            killed_at = time.monotonic()
            self.kills.append(killed_at)
            while time.monotonic() - killed_at < 5:
                if set(child_pids(self.zygote)) - before:
                    self.recoveries.append(time.monotonic() - killed_at)
                    break
                time.sleep(0.0005)


async def phase(sb, clients: int, seconds: float, answers: list):
    end = time.monotonic() + seconds
    statuses: dict[str, int] = {}

    async def caller():
        while time.monotonic() < end:
            r = await sb.run(CALL, timeout=10)
            statuses[r.status] = statuses.get(r.status, 0) + 1
            if r.status == "worker_died":
                answers.append(time.monotonic())
            elif r.status == "ok":
                assert r.stdout == "4950\n", r

    start = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return sum(statuses.values()) / (time.monotonic() - start), statuses


async def main_async(args):
    async with sandbox.LocalSandbox(workers=args.workers) as sb:
        await sb.run_many([{"code": CALL}] * (2 * args.workers))  # warm
        zygote = sb._pool.zygote_pid
        calm_rate, calm = await phase(sb, args.clients, args.seconds, [])
        loop = KillLoop(sb._pool.zygote_pid, args.kill_every_s)
        answers: list[float] = []
        loop.start()
        killed_rate, killed = await phase(sb, args.clients, args.seconds, answers)
        loop.stop.set()
        loop.join()
        start = time.monotonic()
        after = await sb.run_many([{"code": "import time\ntime.sleep(1)\nprint('x')"}] * args.workers)
        side_by_side = time.monotonic() - start
        zygote_kept = sb._pool.zygote_pid == zygote  # workers were replaced, never the whole zygote
    # each answer goes with the latest kill before it
    answer_s = [a - max(k for k in loop.kills if k <= a) for a in answers if any(k <= a for k in loop.kills)]
    return {"calm_rate": calm_rate, "calm": calm, "killed_rate": killed_rate, "killed": killed,
            "kills": len(loop.kills), "answer_ms": [1000 * a for a in answer_s],
            "recovery_ms": [1000 * r for r in loop.recoveries], "after": [r.status for r in after],
            "side_by_side_s": side_by_side, "zygote_kept": zygote_kept}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--kill-every-s", type=float, default=0.25)
    p.add_argument("--record", help="write the section into this BENCHMARKS.md")
    args = p.parse_args(argv)
    out = asyncio.run(main_async(args))

    def pct(xs, q):
        return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")

    table = ("| phase | calls/s | statuses |\n|---|---|---|\n"
             f"| no faults | {out['calm_rate']:.0f} | {out['calm']} |\n"
             f"| a busy worker SIGKILLed every {args.kill_every_s:g} s ({out['kills']} kills) | "
             f"{out['killed_rate']:.0f} ({out['killed_rate'] / out['calm_rate']:.2f}x) | {out['killed']} |\n\n"
             "| after a kill | p50 ms | p90 ms | max ms |\n|---|---|---|---|\n"
             f"| the killed call answered (worker_died) | {statistics.median(out['answer_ms']):.1f} | "
             f"{pct(out['answer_ms'], 0.9):.1f} | {max(out['answer_ms']):.1f} |\n"
             f"| the slot's new worker started | {statistics.median(out['recovery_ms']):.1f} | "
             f"{pct(out['recovery_ms'], 0.9):.1f} | {max(out['recovery_ms']):.1f} |")
    notes = (f"After the kill loop, {args.workers} one-second calls side by side took {out['side_by_side_s']:.2f} s "
             f"(statuses {out['after']}): every slot serves. Every killed call was answered once "
             f"({out['killed'].get('worker_died', 0)} worker_died for {out['kills']} kills; a kill that lands between "
             "calls answers none); " + ("the zygote itself was never restarted." if out["zygote_kept"]
                                         else "the zygote was restarted (a kill landed mid-message)."))
    record(args.record, "Sandbox: a dying worker (kill loop)",
           " ".join(["python -m experiments.benchmarks.sandbox_worker_death", *(sys.argv[1:] if argv is None else argv)]),
           f"LocalSandbox(workers={args.workers}), every protection on; {args.clients} callers of a 20 ms call; "
           f"{args.seconds:g} s per phase", table, notes, group=SANDBOX)


if __name__ == "__main__":
    main()
