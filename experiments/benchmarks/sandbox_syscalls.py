"""The system calls the sandbox's filtered processes make on a workload, measured with strace.

    python -m experiments.benchmarks.sandbox_syscalls [--out DIR]

Runs sandbox/syscall_corpus.py's calls (stateless and in a session) on a strict LocalSandbox with
one slot under `strace -f -ff`, then reads each process's trace from the point its seccomp filter
applies (a worker's own `prctl(PR_SET_SECCOMP, ...)`, or inherited from its parent at the fork)
and prints: every syscall those processes made, those the allow-list (sandbox/zygote/syscall_policy.py)
lacks with how they ended, and the corpus's results. The allow-list was built from this (issue 79);
tests/sandbox/test_supervisor_boundary.py re-checks the corpus under the filter on every run.
Needs root, strace and libseccomp.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\w+)(?:\s+(E\w+))?")
_CHILD = re.compile(r"^(?:clone3?|fork|vfork)\(.*\)\s+=\s+(\d+)")

RUNNER = r"""
import asyncio, json, sys
import sandbox
from sandbox.syscall_corpus import CORPUS

async def main():
    async with sandbox.LocalSandbox(workers=1) as sb:
        print("ZYGOTE", sb.zygote_pid, flush=True)
        for name, code, stdin, want in CORPUS:
            r = await sb.run(code, stdin, 30.0)
            print("RESULT", json.dumps([name, "call", r.status, r.stdout == want, r.stderr[-300:]]), flush=True)
        async with await sb.session() as s:
            for name, code, stdin, want in CORPUS:
                r = await s.run(code, stdin, 30.0)
                print("RESULT", json.dumps([name, "session", r.status, r.stdout == want, r.stderr[-300:]]), flush=True)

asyncio.run(main())
"""


def parse_trace(path: str):
    """(syscalls as (name, result, errno) in order, child pids, index of the seccomp load or None)."""
    calls, children, loaded_at = [], [], None
    with open(path, errors="replace") as f:
        for line in f:
            m = _CALL.match(line)
            if not m:
                continue
            name, args, result, err = m.groups()
            if name == "prctl" and args.startswith("PR_SET_SECCOMP") and result == "0":
                loaded_at = len(calls)
            c = _CHILD.match(line)
            if c:
                children.append((len(calls), int(c.group(1))))
            calls.append((name, result, err))
    return calls, children, loaded_at


def filtered_syscalls(trace_dir: str, zygote_pid: int) -> dict[str, collections.Counter]:
    """{syscall: Counter of outcomes} over every process of the zygote from where its filter applies."""
    traces = {int(n.rsplit(".", 1)[1]): os.path.join(trace_dir, n) for n in os.listdir(trace_dir)}
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    stack = [(zygote_pid, False)]
    while stack:
        pid, inherited = stack.pop()
        if pid not in traces:
            continue
        calls, children, loaded_at = parse_trace(traces[pid])
        start = 0 if inherited else loaded_at
        if start is not None:
            for name, _result, err in calls[start:]:
                seen[name][err or "ok"] += 1
        for at, child in children:
            stack.append((child, inherited or (loaded_at is not None and at >= loaded_at)))
    return seen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="keep the traces here (default: a temporary directory)")
    args = ap.parse_args(argv)
    from sandbox.zygote import syscall_policy

    trace_dir = args.out or tempfile.mkdtemp(prefix="sandbox-strace-")
    os.makedirs(trace_dir, exist_ok=True)
    run = subprocess.run(["strace", "-f", "-ff", "-qq", "-o", os.path.join(trace_dir, "t"), sys.executable, "-c", RUNNER],
                         capture_output=True, text=True, check=False)
    lines = run.stdout.splitlines()
    zygote = next((int(line.split()[1]) for line in lines if line.startswith("ZYGOTE")), None)
    if zygote is None:
        sys.exit(f"the sandbox did not start under strace:\n{run.stderr[-2000:]}")
    results = [line[len("RESULT "):] for line in lines if line.startswith("RESULT")]
    seen = filtered_syscalls(trace_dir, zygote)
    allowed = set(syscall_policy.CALL_SYSCALLS) | set(syscall_policy.WORKER_SYSCALLS) | {"clone", "clone3",
                                                                                           "personality", "socket"}
    print(f"{len(seen)} syscalls made by the zygote's filtered processes ({sum(sum(c.values()) for c in seen.values())} calls):")
    print(" ".join(sorted(seen)))
    lacking = {name: dict(c) for name, c in seen.items() if name not in allowed}
    print(f"not in the allow-list ({len(lacking)}): {lacking or 'none'}")
    print(f"corpus ({len(results)} runs):")
    for r in results:
        print("  ", r)
    print(f"traces: {trace_dir}")


if __name__ == "__main__":
    main()
