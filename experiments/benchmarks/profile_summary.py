"""Top device operations of a JAX profiler trace (the perfetto JSON that jax.profiler writes).

    python -m experiments.benchmarks.profile_summary /tmp/trace_dir [--top 25]

Sums the duration of every device-side event by name, so "where did the step go" is one table
without TensorBoard.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os


def _trace_file(trace_dir: str) -> str:
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise SystemExit(f"no *.trace.json.gz under {trace_dir}")
    return files[-1]


@functools.lru_cache(maxsize=2)
def _load(path: str, mtime: float) -> tuple[dict, ...]:
    """A trace file's events, read once (a GPU trace runs to hundreds of MB, and a profile's summary
    reads it for its busy time, its kernel families and its top ops); keyed by modification time,
    so a trace written again is read again."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return tuple(trace["traceEvents"] if isinstance(trace, dict) else trace)


def _trace_events(trace_dir: str) -> tuple[dict, ...]:
    path = _trace_file(trace_dir)
    return _load(path, os.path.getmtime(path))


def _device_events(trace_dir: str) -> list[dict]:
    events = _trace_events(trace_dir)
    device_pids = {e["pid"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and any(k in str(e.get("args", {}).get("name", "")) for k in ("/device:GPU", "/device:TPU"))}
    # no accelerator (a CPU run): the host's ops
    return [e for e in events if e.get("ph") == "X" and (e.get("pid") in device_pids or not device_pids)]


def _kernel_events(trace_dir: str) -> list[dict]:
    """The device's kernels and copies: on a GPU trace its "Stream" lines (the device's process
    also has lines of XLA modules and ops that span the kernels they launch: counted there, each
    kernel would count two or three times); where no line is named so, every device event."""
    streams = {(e.get("pid"), e.get("tid")) for e in _trace_events(trace_dir)
               if e.get("ph") == "M" and e.get("name") == "thread_name"
               and "stream" in str(e.get("args", {}).get("name", "")).lower()}
    events = _device_events(trace_dir)
    return [e for e in events if (e.get("pid"), e.get("tid")) in streams] if streams else events


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


# Kernel families, first match wins (names as XLA's GPU backend and the Pallas kernels spell them):
# what a decode step spends, family by family, says which lever is left (the KV read is attention's,
# the weights' read the matmuls', and many short kernels of the rest point at launches).
CATEGORIES = (
    ("attention", ("mha_forward", "paged_attention", "flash", "attention")),
    ("matmul", ("gemm", "cublas", "cutlass", "matmul", "dot", "triton_gemm")),
    ("kv scatter", ("scatter",)),
    ("copy", ("memcpy", "memset", "copy", "concatenate", "dynamic_update_slice", "dynamic_slice")),
    ("reduction", ("reduce", "sort", "argmax", "cub")),
    ("other fusions", ("",)),
)


def category(name: str) -> str:
    lower = name.lower()
    return next(c for c, keys in CATEGORIES if any(k in lower for k in keys))


def by_category(trace_dir: str, steps: int, from_op: str | tuple[str, ...] = "") -> str:
    """Kernels and their device time by family over the decode (from the first event naming
    `from_op`, as busy_ms), per decode step: how many kernels a step launches and how long they
    run on average (a step of many kernels of a few microseconds each is bound by their count, not
    by the bytes they move)."""
    markers = (from_op,) if isinstance(from_op, str) else tuple(from_op)
    events = sorted(_kernel_events(trace_dir), key=lambda e: float(e["ts"]))
    first = next((i for i, e in enumerate(events) if any(m in e["name"] for m in markers)), 0)
    counts: collections.Counter = collections.Counter()
    times: collections.Counter = collections.Counter()
    for e in events[first:]:
        c = category(e["name"])
        counts[c] += 1
        times[c] += float(e.get("dur", 0.0))
    steps = max(steps, 1)
    total = sum(times.values())
    lines = [f"by kernel family over {steps} decode steps: {sum(counts.values()) / steps:.0f} kernels and "
             f"{total / steps / 1e3:.3f} ms of kernel time a step",
             "| family | kernels a step | ms a step | mean us a kernel | share |", "|---|---|---|---|---|"]
    for c, _ in CATEGORIES:
        if counts[c]:
            lines.append(f"| {c} | {counts[c] / steps:.1f} | {times[c] / steps / 1e3:.3f} | "
                         f"{times[c] / counts[c]:.1f} | {times[c] / max(total, 1e-9):.1%} |")
    return "\n".join(lines)


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
