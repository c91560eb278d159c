"""The embedded engine on devices of its own (rollout.jax.devices, issue 70), through the trainer:
the tiny recipe asynchronous (rl.max_staleness=1) on 8 fake CPU devices, the engine sharing all 8
against the engine on 4 of its own and the learner on the other 4 (one subprocess,
tests/rl/own_devices_main.py)."""

import pytest

from tests.fake_devices import run_on_8_fake_devices
from tests.rl.test_training import COMPARED, close_to_rounding


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
    for a, b in zip(shared["metrics"], own["metrics"]):
        for key in COMPARED:
            if key in a:
                assert close_to_rounding(b[key], a[key], key), (a["step"], key)
