"""The embedded engine on devices of its own (rollout.jax.devices, issue 70), through the trainer:
the tiny recipe asynchronous (rl.max_staleness=1, 2 steps, updates that move the weights) from the
random model on 8 fake CPU devices, the engine sharing all 8 against the engine on 4 of its own and
the learner on the other 4 (one subprocess, tests/rl/own_devices_main.py); and over two processes."""

import pytest

from tests.fake_devices import run_on_8_fake_devices
from tests.rl.test_training import COMPARED, close_to_rounding


def assert_the_weights_moved_and_reached_the_engine(metrics, engine_versions: list[int]):
    """Every update moved the weights (advantages of alternating signs: the random policy solves
    nothing, so GRPO's would all be zero and nothing would move), and both updates' weights reached
    every engine (their versions). That the engine then samples what one device with those weights
    samples is tests/rollout/test_sharded_engine.py's; here a third step would race the second
    update's landing against its own generation, which two placements time differently."""
    assert len(metrics) == 2 and all(m["update_norm"] > 0 for m in metrics)
    assert engine_versions == [2] * len(engine_versions)


@pytest.mark.slow
def test_an_asynchronous_run_with_the_engine_on_its_own_devices_keeps_each_side_on_its_own_and_matches_shared():
    [out] = run_on_8_fake_devices("tests.rl.own_devices_main")
    shared, own = out["shared"], out["own"]
    assert shared["learner_on"] == shared["engine_on"] == list(range(8))
    # the learner's mesh is the first four devices, and the engine's weights (resharded onto its
    # tensor mesh after every update) are only on the last four
    assert own["learner_on"] == [0, 1, 2, 3] and own["engine_on"] == [4, 5, 6, 7]
    # the same first rollouts (the same weights and seeds, tensor-split 4 ways instead of 8), and
    # the same metrics at every step
    assert own["step0"] == shared["step0"]
    assert [m["step"] for m in own["metrics"]] == [m["step"] for m in shared["metrics"]] == [0, 1]
    assert_the_weights_moved_and_reached_the_engine(own["metrics"], [own["engine_version"]])
    for a, b in zip(shared["metrics"], own["metrics"]):
        for key in COMPARED:
            if key in a:
                assert close_to_rounding(b[key], a[key], key), (a["step"], key)


@pytest.mark.slow
def test_over_two_processes_each_engine_has_a_device_of_its_own_and_the_run_matches_shared(tmp_path):
    """Issue 70, item 2, over several processes (jax.distributed, 2 fake CPU devices each): with
    rollout.jax.devices=1 the learner's arrays span one device of each process (a mesh across
    processes) and each process's engine lives on its other device, resharded to after every
    update; the run's metrics are the shared placement's to rounding."""
    import json
    import sys

    from tests.rl.launch import launch

    runs = {}
    for name, own in (("shared", 0), ("own", 1)):
        work = tmp_path / name
        results = launch([sys.executable, "-m", "tests.rl.own_devices_processes_main", str(work), str(own)],
                         tmp_path / name, n=2, devices_per_process=2)
        for status, _, err in results:
            assert status == 0, err[-3000:]
        runs[name] = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    every = sorted(d for p in runs["shared"] for d in p["local"])
    assert len(every) == 4
    for p in runs["shared"]:  # the learner over all four, each engine over its process's two
        assert p["learner_on"] == every and p["engine_on"] == p["local"]
    own = runs["own"]
    learner = {d for p in own for d in p["learner_on"]}
    assert all(p["learner_on"] == sorted(learner) for p in own) and len(learner) == 2
    for p in own:  # one device of each process for the learner, the other for the engine
        assert len(p["engine_on"]) == 1 and p["engine_on"][0] in p["local"] and p["engine_on"][0] not in learner
        assert len(set(p["local"]) & learner) == 1
    shared, split = runs["shared"][0]["metrics"], own[0]["metrics"]
    assert [m["step"] for m in split] == [m["step"] for m in shared] == [0, 1]
    assert_the_weights_moved_and_reached_the_engine(split, [p["engine_version"] for p in own])
    for a, b in zip(shared, split):
        for key in COMPARED:
            if key in a:
                assert close_to_rounding(b[key], a[key], key), (a["step"], key)
