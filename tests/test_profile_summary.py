"""experiments.benchmarks.profile_summary: the device's busy time is the union of its events'
intervals (overlapping streams and nested module/op events count once)."""

import gzip
import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.benchmarks import profile_summary

_DEVICE = 7


def _write_trace(tmp_path, events, threads=()) -> str:
    """events: (name, ts, dur[, tid]) on the device (tid 1 unless given); threads: (tid, name) lines."""
    trace = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": _DEVICE, "args": {"name": "/device:GPU:0"}},
                             {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
             + [{"ph": "M", "name": "thread_name", "pid": _DEVICE, "tid": t, "args": {"name": n}} for t, n in threads]
             + [{"ph": "X", "pid": _DEVICE, "tid": (e[3] if len(e) > 3 else 1), "name": e[0], "ts": e[1], "dur": e[2]}
                for e in events]
             + [{"ph": "X", "pid": 1, "tid": 1, "name": "host work", "ts": 0, "dur": 10 ** 9}]}
    run = tmp_path / "plugins" / "profile" / "run"
    os.makedirs(run, exist_ok=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump(trace, f)
    return str(tmp_path)


def test_busy_time_counts_overlaps_once_and_starts_at_the_named_op(tmp_path):
    # a prefill (0-100 us), then decode ops on two streams overlapping (200-300, 250-400) and a gap
    trace = _write_trace(tmp_path, [("prefill_fusion", 0, 100), ("decode_chunk", 200, 100),
                                    ("gemm", 250, 150), ("gemm", 600, 100)])
    busy, span, found = profile_summary.busy_ms(trace, from_op="decode")
    assert found and (busy, span) == (0.3, 0.5)  # 200-400 and 600-700 of 200-700, in ms
    busy, span, found = profile_summary.busy_ms(trace, from_op="no such op")
    assert not found and (busy, span) == (0.4, 0.7)  # the whole trace; the host's event never counts


def test_a_gpu_decode_is_found_by_the_first_kernel_only_it_runs(tmp_path):
    """A GPU trace names kernels: the Pallas decode kernel marks where the decode begins."""
    trace = _write_trace(tmp_path, [("gemm_fusion_dot_1", 0, 100), ("gemm_fusion_dot_1", 200, 50),
                                    ("mha_forward", 250, 50), ("gemm_fusion_dot_1", 400, 100)])
    busy, span, found = profile_summary.busy_ms(trace, from_op=("mha_forward", "paged_attention"))
    assert found == "mha_forward" and (busy, span) == (0.15, 0.25)  # 250-300 and 400-500 of 250-500


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)), min_size=1, max_size=20))
def test_busy_time_is_the_union_of_the_intervals(tmp_path_factory, spans):
    trace = _write_trace(tmp_path_factory.mktemp("t"), [("op", ts, d) for ts, d in spans])
    busy, span, _ = profile_summary.busy_ms(trace)
    covered = set()
    for ts, d in spans:
        covered.update(range(ts, ts + d))
    assert abs(busy * 1e3 - len(covered)) < 1e-6
    assert busy <= span + 1e-9


def test_kernels_by_family_count_the_stream_s_kernels_per_step_from_the_decode_on(tmp_path):
    """The device's "XLA Ops" line spans the kernels its ops launch: only the stream's kernels are
    counted, from the first decode kernel on (the prefill's gemm before it is left out)."""
    stream, ops = 1, 2
    trace = _write_trace(tmp_path, [
        ("gemm_fusion_dot_0", 0, 500),                                       # the prefill
        ("mha_forward", 1000, 40), ("gemm_fusion_dot_1", 1040, 10), ("input_scatter_fusion", 1050, 2),
        ("loop_multiply_fusion", 1052, 3), ("gemm_fusion_dot_1", 1100, 10), ("mha_forward", 1110, 40),
        ("input_scatter_fusion", 1150, 2), ("loop_multiply_fusion", 1152, 3),
        ("gemm_fusion_dot_1", 1040, 10, ops), ("mha_forward", 1000, 40, ops),  # the ops line: not kernels
    ], threads=[(stream, "Stream #13(Compute)"), (ops, "XLA Ops")])
    table = profile_summary.by_category(trace, steps=2, from_op=("mha_forward",))
    assert "4 kernels and 0.055 ms of kernel time a step" in table, table
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in table.splitlines()[3:]}
    assert [float(x) for x in rows["attention"]] == [1.0, 0.04, 40.0]
    assert [float(x) for x in rows["matmul"]] == [1.0, 0.01, 10.0]
    assert [float(x) for x in rows["kv scatter"]] == [1.0, 0.002, 2.0]
    assert [float(x) for x in rows["other fusions"]] == [1.0, 0.003, 3.0]
    assert profile_summary.category("input_scatter_fusion_3") == "kv scatter"
    assert profile_summary.category("paged_attention_kernel") == "attention"
