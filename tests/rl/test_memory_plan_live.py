"""The memory plan's persistent lines against the bytes of live arrays on each of 8 fake CPU
devices (one subprocess, tests/rl/plan_memory_main.py): the learner's state, the embedded
engine's weights and KV, and what a vLLM sync's export holds. (The update's transient lines,
gradients and activations, are checked against XLA:GPU: BENCHMARKS.md "Memory plan against JAX
on one GPU"; tests/rl/test_memory_plan.py checks the state lines against XLA's arguments.)"""

import pytest


@pytest.fixture(scope="module")
def live_bytes_on_8_devices() -> list[dict]:
    """One subprocess with 8 fake CPU devices for both plan-against-live-arrays checks."""
    from tests.fake_devices import run_on_8_fake_devices
    return run_on_8_fake_devices("tests.rl.plan_memory_main")


@pytest.mark.slow  # a subprocess with 8 fake CPU devices (~30 s), shared by the three checks
def test_the_export_holds_no_more_than_the_plan_s_weight_sync_line(live_bytes_on_8_devices):
    """Parameters sharded over 8 devices, exported in bf16: the bytes of live arrays on any device
    beyond the parameters, sampled at every tensor handed to the writer, stay within the memory
    plan's weight-sync line (two of the largest tensors), on the accelerator path (the device lays
    each tensor out) and on the CPU one. Dispatching a bucket's tensors all at once (the first
    version of weight_export) held the whole bf16 model here: 3.9x the line; laying a sharded
    tensor out on the devices replicated each copy: 9.9x."""
    results = [r for r in live_bytes_on_8_devices if r["what"] == "export"]
    assert len(results) == 2
    for r in results:
        assert r["sharded"] and r["buckets"] == 1 and r["equal"], r  # and what it wrote is the model
        assert 0.5 * r["line"] <= r["extra"] <= r["line"], r


@pytest.mark.slow
def test_the_embedded_engine_holds_what_the_plan_s_engine_lines_say(live_bytes_on_8_devices):
    """The embedded engine, built as a run builds it on 8 devices, holds on every device exactly
    the plan's engine weights + KV pool lines: bf16 weights split over the devices by the rules,
    and a KV cache of 2 KV heads, which cannot split 8 ways and so is whole on each device; for
    row KV (slots x max_len) and for a paged pool smaller than that. A plan that split the KV by
    the device count, or counted slots x max_len whatever the pages, fails here (within 1%)."""
    results = [r for r in live_bytes_on_8_devices if r["what"] == "engine"]
    assert [r["page_size"] for r in results] == [0, 16], results
    for r in results:
        assert r["engine_devices"] == 8 and "split 1 way(s)" in r["kv_how"], r
        line = r["weights_line"] + r["kv_line"]
        assert len(r["extra"]) == 8 and all(abs(extra - line) <= 0.01 * line for extra in r["extra"]), r


@pytest.mark.slow
def test_the_learner_holds_what_the_plan_s_state_lines_say(live_bytes_on_8_devices):
    """The learner on an 8-device FSDP mesh, between updates: every device holds the plan's
    parameters + optimizer lines (float32 weights and AdamW's two moments, split by the rules)
    within 1% (the step counter and small unsplittable vectors aside). A plan without the second
    moment, or with bf16 master weights, fails here."""
    [r] = [r for r in live_bytes_on_8_devices if r["what"] == "learner"]
    assert r["mesh"]["fsdp"] * r["mesh"]["data"] * r["mesh"]["tensor"] == 8, r
    assert len(r["extra"]) == 8 and all(abs(extra - r["line"]) <= 0.01 * r["line"] for extra in r["extra"]), r


@pytest.mark.slow  # two processes of 2 fake CPU devices each (~30 s)
def test_over_two_processes_the_state_and_sync_lines_hold():
    """Parameters split over 2 processes x 2 devices: each device holds the plan's parameters +
    optimizer lines (within 1%), and while process 0 exports in bf16 (each tensor gathered whole
    by both processes, process 1 taking part only) no device holds more beyond that state than
    the plan's weight-sync line, two whole tensors. Counting the line split like the parameters
    (as for one process) fails here: the gathered tensors are whole."""
    from tests.fake_devices import run_as_processes

    results = sorted(run_as_processes("tests.rl.plan_memory_processes_main"), key=lambda r: r["process"])
    assert [r["process"] for r in results] == [0, 1], results
    for r in results:
        assert r["split_over_processes"] and "gathered over 2 processes" in r["sync_how"], r
        assert len(r["state"]) == 2 and all(abs(s - r["state_line"]) <= 0.01 * r["state_line"] for s in r["state"]), r
        assert 0.5 * r["sync_line"] <= r["export_extra"] <= r["sync_line"], r
