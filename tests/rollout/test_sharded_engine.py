"""The embedded engine split over a process's devices (8 fake CPU devices, in a subprocess):
same tokens as on one device, each device holding an eighth of the weights and the KV, in the
dtype it is given, with a KV pool sized by a memory budget."""

import dataclasses

import pytest

from rstar2_jax.rollout.engines.jax_engine.kind import kv_pool_pages
from rstar2_jax.rollout.engines.jax_engine.settings import JaxEngineSettings
from rstar2_jax.models.tiny import tiny_config
from tests.fake_devices import run_on_8_fake_devices


@pytest.fixture(scope="module")
def result():
    return run_on_8_fake_devices("tests.rollout.sharded_engine_main")[0]

@pytest.mark.slow
def test_engine_over_8_devices_gives_the_single_device_tokens(result):
    assert result["split"]["tokens"] == result["single"]["tokens"]
    assert result["mesh_of_8"] == {"data": 1, "fsdp": 1, "tensor": 8}
    assert result["pallas_mesh"] == {"data": 1, "fsdp": 1, "tensor": 8}  # Pallas decode splits by heads too


@pytest.mark.slow
def test_the_pallas_decode_kernels_under_tensor_parallelism_give_the_single_device_tokens(result):
    """Issue 70 item 2: the ragged and the paged Pallas kernels run by KV heads under shard_map
    over 8 devices (interpreted on the CPU), with the tokens of one device, and of XLA's attention."""
    p = result["pallas"]
    assert p["rows_split"] == p["rows_single"] and p["paged_split"] == p["paged_single"]
    assert p["paged_single"] == result["single"]["tokens"]

@pytest.mark.slow
def test_each_device_holds_an_eighth_of_the_weights_and_kv_in_the_given_dtype(result):
    for run in (result["split"], result["split_bf16"]):
        assert run["q_proj_shard_fraction"] == run["kv_shard_fraction"] == 1 / 8, run
    assert result["single"]["q_proj_shard_fraction"] == 1.0
    assert result["split"]["q_proj_dtype"] == "float32" and result["split_bf16"]["q_proj_dtype"] == "bfloat16"

@pytest.mark.slow
def test_the_kv_pool_holds_what_its_memory_budget_holds(result):
    # a budget of 6 float32 pages holds 6 float32 pages, or 12 bf16 ones
    assert result["split"]["pages"] == result["single"]["pages"] == 6
    assert result["split_bf16"]["pages"] == 12

@pytest.mark.slow
def test_an_engine_on_devices_of_its_own_gets_the_learners_weights_device_to_device(result):
    """rollout.jax.devices=4 of 8 (issue 70): the learner's fsdp-sharded weights on devices 0-3
    resharded onto the engine's tensor mesh on 4-7; the engine then samples what one device with
    those weights samples, and nothing of it lives on the learner's devices."""
    own = result["own"]
    assert own["learner_on"] == [0, 1, 2, 3] and own["engine_on"] == [4, 5, 6, 7]
    assert own["tokens"] == result["single"]["tokens"] and own["versions"] == [1]
    print(f"sync to own devices {own['copy_own_s'] * 1e3:.1f} ms, to shared ones {own['copy_shared_s'] * 1e3:.1f} ms")


@pytest.mark.slow
def test_replicas_on_the_engines_devices_give_the_single_device_tokens_and_keep_a_session_home(result):
    """rollout.jax.replicas=4 over rollout.jax.devices=4 (issue 70 item 2): four one-device
    engines on devices 4-7 behind the kv_aware scheduler; each took the sync (version 1) on its own
    device; greedy tokens equal one device's; the turns spread over the replicas and a
    trajectory's next turn goes back to the replica holding its prefix."""
    r = result["replicas"]
    assert r["on"] == [[4], [5], [6], [7]] and r["versions"] == [1, 1, 1, 1]
    assert r["tokens"] == result["single"]["tokens"]
    assert sum(r["dispatched"]) == 6 and sum(d > 0 for d in r["dispatched"]) >= 3 and r["stayed"] == 1


def test_the_engines_own_devices_leave_the_learner_some_or_are_refused_naming_both():
    from types import SimpleNamespace

    from rstar2_jax.rollout.engines import RolloutConfig
    from rstar2_jax.rollout.engines.jax_engine.kind import split_devices
    devices = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]  # two processes of 4
    def own(n):
        return dataclasses.replace(RolloutConfig(), jax=dataclasses.replace(RolloutConfig().jax, devices=n))

    assert split_devices(own(0), devices) == (devices, devices)  # 0: shared
    learner, engine = split_devices(own(1), devices)
    assert [d.id for d in engine] == [3, 7] and [d.id for d in learner] == [0, 1, 2, 4, 5, 6]
    with pytest.raises(ValueError, match=r"rollout.jax.devices=4 asks for 4 of process 0's 4 devices, which leaves "
                                         r"the learner 0: set it to at most 3"):
        split_devices(own(4), devices)


def test_kv_budget_sizes_the_pool_and_refuses_less_than_one_sequence():
    cfg = tiny_config()  # 2 layers x 2 KV heads x 32 dims: 1 KiB per position in float32
    budget = JaxEngineSettings(page_size=64, kv_memory_gb=10 * 64 * 1024 / 2**30)
    assert kv_pool_pages(budget, 256, cfg, 4) == 10
    assert kv_pool_pages(budget, 256, cfg, 2) == 20
    assert kv_pool_pages(JaxEngineSettings(page_size=64, kv_pages=7), 256, cfg, 4) == 7
    assert kv_pool_pages(JaxEngineSettings(), 256, cfg, 4) is None
    with pytest.raises(ValueError, match="fewer than one rollout.max_len=256 sequence"):
        kv_pool_pages(JaxEngineSettings(page_size=64, kv_memory_gb=3 * 64 * 1024 / 2**30), 256, cfg, 4)
