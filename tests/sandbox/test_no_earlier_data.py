"""No call or session can read an earlier call's or session's data from its own memory (issue 24,
item 1): a call is forked from a worker, so whatever the worker ever held is in the call's address
space. Each probe scans every readable mapping of its own process (/proc/self/maps and
/proc/self/mem) for markers of earlier calls' code, stdin, stdout and stderr, light and heavy
workers, stateless calls and sessions.

A marker is two random halves; the scanner holds the halves apart and looks for one directly
followed by the other, so it never finds its own copy."""

import asyncio
import secrets

import pytest

import sandbox

SCAN = '''import ctypes
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/mem readable after setuid
heads, tails = {heads!r}, {tails!r}
found = set()
mem = open("/proc/self/mem", "rb", 0)
for line in open("/proc/self/maps"):
    span, perms = line.split()[:2]
    lo, hi = (int(x, 16) for x in span.split("-"))
    if "r" not in perms or hi - lo > 1 << 30:
        continue
    try:
        mem.seek(lo)
        chunk = mem.read(hi - lo)
    except (OSError, ValueError, OverflowError):
        continue
    for i, head in enumerate(heads):
        at = chunk.find(head)
        while at >= 0:
            if chunk[at + len(head):at + len(head) + len(tails[i])] == tails[i]:
                found.add(i)
            at = chunk.find(head, at + 1)
print(sorted(found))
{heavy}'''


def _markers(n):
    return [(secrets.token_hex(8), secrets.token_hex(8)) for _ in range(n)]


def _marked_call(marks, heavy=False):
    """(code, stdin) of a call whose code, stdin, stdout and stderr each hold one marker."""
    (c, s, o, e) = ["".join(m) for m in marks]
    code = (("import numpy\n" if heavy else "") + f"import sys\nx = {c!r}\ns = sys.stdin.read()\n"
            f"print({marks[2][0]!r} + {marks[2][1]!r})\nprint({marks[3][0]!r} + {marks[3][1]!r}, file=sys.stderr)")
    assert o not in code and e not in code
    return code, s


def _scan(marks, heavy=False):
    return SCAN.format(heads=[m[0].encode() for m in marks], tails=[m[1].encode() for m in marks],
                       heavy="import numpy  # runs on the heavy worker\n" if heavy else "")


@pytest.mark.slow
def test_no_call_or_session_finds_earlier_calls_data_in_its_memory():
    async def go():
        async with sandbox.LocalSandbox(workers=1, preload=("math", "numpy"), default_timeout=60.0) as sb:
            out = {}
            for heavy in (False, True):  # one slot: every call below runs on this slot's worker
                marks = _markers(4)
                code, stdin = _marked_call(marks, heavy)
                first = await sb.run(code, stdin)
                assert first.status == "ok" and "".join(marks[2]) in first.stdout, first
                for _ in range(3):
                    await sb.run("print(1)" + ("\nimport numpy" if heavy else ""))
                out["heavy" if heavy else "light"] = await sb.run(_scan(marks, heavy))
            # a session's cells, then a new session and a stateless call look for them
            marks = _markers(4)
            code, stdin = _marked_call(marks)
            async with await sb.session() as s:
                cell = await s.run(code, stdin)
                assert cell.status == "ok" and "".join(marks[3]) in cell.stderr, cell
                async with await sb.session() as other:
                    out["session after session"] = await other.run(_scan(marks))
            out["call after session"] = await sb.run(_scan(marks, heavy=True))
            return out

    for where, result in asyncio.run(go()).items():
        assert result.status == "ok", (where, result)
        assert result.stdout == "[]\n", f"{where}: markers {result.stdout.strip()} of (code, stdin, stdout, stderr) found"
