"""The train step on 8 fake CPU devices equals the single-device step."""

import pytest

from tests.fake_devices import run_on_8_fake_devices

pytestmark = pytest.mark.slow  # a subprocess that compiles the step on 8 fake devices (~1 min)


@pytest.fixture(scope="module")
def results():
    return run_on_8_fake_devices("tests.learner.sharded_step_main")


@pytest.mark.parametrize("index", [0, 1], ids=["fsdp=8", "data=2,fsdp=2,tensor=2"])
def test_sharded_update_equals_unsharded(results, index):
    r = results[index]
    # Adam divides by sqrt(v): for near-zero gradients, reduction-order noise moves a weight by up
    # to ~lr; a wrong sharding moves many weights by ~lr. lr = 1e-3 here.
    assert r["max_param_diff"] < 5e-5, r
    assert abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-5 * r["ref_grad_norm"], r
    assert "fsdp" in r["spec"], r  # parameters really are sharded


def test_learner_pads_a_batch_that_does_not_divide_the_mesh(results):
    r = results[3]
    assert r["rows_multiple"] == 8 * 2 and r["rows"] == 16  # 2 micro-batches x data 2 x fsdp 4
    assert "data" in r["spec"] and "fsdp" in r["spec"], r  # the batch really is split, not replicated
    assert r["entropy_rows"] == 3  # what the caller gets back is its own 3 rows
    assert r["max_param_diff"] < 5e-5 and abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-5 * r["ref_grad_norm"], r


def test_lora_adapters_trained_over_fsdp_with_the_base_split_equal_the_one_device_update(results):
    r = results[4]
    assert r["mesh"] == "lora" and r["trained"] == 2 * 7 * 2, r  # A and B of 7 projections x 2 layers
    assert r["max_param_diff"] < 5e-5 and abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-5 * r["ref_grad_norm"], r
    assert "fsdp" in r["spec"], r  # the frozen base really is split


def test_packed_rows_split_over_the_mesh_equal_the_unsharded_padded_update(results):
    r = results[2]
    assert r["mesh"] == "packed" and r["packed_rows"] == 1.0 and r["width"] == 8, r
    assert r["max_param_diff"] < 5e-5 and abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-5 * r["ref_grad_norm"], r
    assert "fsdp" in r["spec"], r
