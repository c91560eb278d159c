"""Top device operations of a JAX profiler trace (the perfetto JSON that jax.profiler writes).

    python -m experiments.benchmarks.profile_summary /tmp/trace_dir [--top 25]

Sums the duration of every device-side event by name, so "where did the step go" is one table
without TensorBoard.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def _device_events(trace_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device_pids = {e["pid"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and any(k in str(e.get("args", {}).get("name", "")) for k in ("/device:GPU", "/device:TPU"))}
    # no accelerator (a CPU run): the host's ops
    return [e for e in events if e.get("ph") == "X" and (e.get("pid") in device_pids or not device_pids)]


def device_op_times(trace_dir: str) -> tuple[collections.Counter, float]:
    totals: collections.Counter = collections.Counter()
    for e in _device_events(trace_dir):
        totals[e["name"]] += float(e.get("dur", 0.0))
    return totals, sum(totals.values())


def busy_ms(trace_dir: str, from_op: str | tuple[str, ...] = "") -> tuple[float, float, str]:
    """(busy, span, first) in ms: the time the device was doing anything (the union of its events'
    intervals: streams and nested module/op events overlap, so a plain sum would over-count) and
    the span it is measured over, from the first event whose name holds `from_op` (or one of
    them: say ("mha_forward", "paged_attention"), to leave out a prefill before it) to the last event's
    end. first is that event's name, "" when none has one: then the span is the whole trace's.
    A GPU trace names kernels, not programs (unless it has a modules line), so a decode is found
    by a kernel only it runs: the Pallas decode kernels, `mha_forward` and `paged_attention_*`."""
    markers = (from_op,) if isinstance(from_op, str) else tuple(from_op)
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
                   for e in _device_events(trace_dir))
    first = next((i for i, (_, _, name) in enumerate(spans) if any(m in name for m in markers)), None)
    found = spans[first][2] if first is not None else ""
    spans = spans[first or 0:]
    if not spans:
        return 0.0, 0.0, found
    busy, end = 0.0, float("-inf")
    for start, stop, _ in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3, (end - spans[0][0]) / 1e3, found


def summarize(trace_dir: str, top: int = 25) -> str:
    totals, total = device_op_times(trace_dir)
    lines = [f"device time in trace: {total / 1e3:.1f} ms over {len(totals)} distinct ops",
             "| op | ms | share |", "|---|---|---|"]
    for name, us in totals.most_common(top):
        lines.append(f"| {name[:90]} | {us / 1e3:.2f} | {us / max(total, 1e-9):.1%} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summarize(args.trace_dir, args.top))


if __name__ == "__main__":
    main()
