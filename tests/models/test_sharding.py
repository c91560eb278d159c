"""Sharded forward on 8 fake CPU devices equals the unsharded forward."""

import pytest
from jax.sharding import PartitionSpec as P

from rstar2_jax.core import sharding
from tests.fake_devices import run_on_8_fake_devices


@pytest.fixture(scope="module")
def sharded_results():
    return run_on_8_fake_devices("tests.models.sharded_forward_main")


@pytest.mark.slow
@pytest.mark.parametrize("index,axes", [(0, "fsdp=8"), (1, "fsdp=4,tensor=2"), (2, "data=2,fsdp=2,tensor=2")])
def test_sharded_forward_equals_unsharded(sharded_results, index, axes):
    result = [r for r in sharded_results if "mesh" in r][index]
    assert result["max_abs_diff"] <= 1e-5, result
    assert result["q_proj_shards"] == 8
    # Parameters really are split: q_proj's embed dim over fsdp (and heads over tensor).
    assert "fsdp" in result["q_proj_spec"], result
    if "tensor" in axes:
        assert "tensor" in result["q_proj_spec"] and "tensor" in result["embed_spec"], result


@pytest.mark.slow
def test_loading_onto_a_mesh_holds_about_one_tensor_on_the_host(sharded_results):
    """Each tensor goes from its safetensors file straight onto its shards: the host never holds
    more than the file's tensor and its layout change (2 tensors), never the model (13x)."""
    result = next(r for r in sharded_results if r.get("check") == "host_memory")
    assert result["model_bytes"] >= 12 * result["largest_tensor_bytes"], result
    assert result["peak_bytes"] <= 2.5 * result["largest_tensor_bytes"], result
    assert result["all_on_intended_sharding"] and result["sharded_params"] >= 20, result


def test_logical_rules_replicate_what_does_not_divide():
    class FakeMesh:  # only .shape is consulted
        shape = {"data": 1, "fsdp": 4, "tensor": 2}

    assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 32), FakeMesh()) == P("fsdp", "tensor", None)
    assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 3, 32), FakeMesh()) == P("fsdp", None, None)
    assert sharding.logical_to_spec(("embed",), (6,), FakeMesh()) == P(None)
    # batch takes (data, fsdp); data has size 1 so only fsdp remains
    assert sharding.logical_to_spec(("batch", "sequence"), (8, 5), FakeMesh()) == P("fsdp", None)
    with pytest.raises(KeyError, match="no sharding rule for logical axis 'bogus'"):
        sharding.logical_to_spec(("bogus",))


def test_make_mesh_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.make_mesh(data=2, fsdp=2, tensor=1, devices=[object()] * 3)
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        sharding.make_mesh(data=-1, fsdp=-1)
