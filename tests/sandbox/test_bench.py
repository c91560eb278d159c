"""The benchmark tool runs end to end and its burst mode counts lost results (speed is recorded
in BENCHMARKS.md, not asserted here)."""

import argparse

from sandbox import bench


def test_bench_smoke_reports_every_workload_and_no_lost_burst_results(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    args = parser.parse_args(["--workers", "2", "--calls", "12", "--baseline-calls", "2", "--burst", "60",
                              "--json", str(tmp_path / "bench.json")])
    report = bench.main(args)
    assert set(report["workloads"]) == {"trivial", "sympy", "mixed"}
    for name, w in report["workloads"].items():
        assert w["sandbox"]["calls"] == 12 and w["sandbox"]["calls_per_s"] > 0
        expected_errors = 2 if name == "mixed" else 0  # the mixed set holds one failing call of 9
        assert w["sandbox"]["statuses"].get("error", 0) <= expected_errors
    assert report["burst"] == {**report["burst"], "calls": 60, "results": 60, "wrong_or_lost": 0}
    assert (tmp_path / "bench.json").exists()
