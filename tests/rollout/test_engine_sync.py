"""Engine.sync_weights, the one call the trainer makes after every update (rollout/engines/base.py): an
engine whose weights are its own updates in place; on shared servers (the protocol of
vllm_engine/sync/shared_servers.py) a push that fails part-way is made once more and counted, a
second failure stops the run. The real protocol over two trainer processes and vLLM servers:
tests/rollout/test_vllm_engine.py."""

import asyncio

import pytest

from rstar2_jax.rollout.engines.base import Engine, ServerLoad, WeightSyncFailed
from rstar2_jax.rollout.engines.vllm_engine.sync.shared_servers import SyncUnit


class OwnWeights(Engine):
    """An engine whose weights are its own: its pushes fail `fails` times (nothing retries them)."""

    def __init__(self, fails: int):
        self.fails, self.pushes = fails, []

    async def generate(self, prompt_ids, sampling, stop=(), *, session=None):
        raise NotImplementedError

    def update_weights(self, params, version=None):
        self.pushes.append(version)
        if self.fails:
            self.fails -= 1
            return  # the servers were rolled back: the version stays the old one
        self.version = version

    def load(self):
        return ServerLoad()

    async def close(self):
        pass


class ServedStandIn(SyncUnit, OwnWeights):
    """A stand-in beside the real servers (VLLMEngine's sync unit): pushes fail `fails` times, then land."""
    weights_on_servers = True
    update_weights = OwnWeights.update_weights  # (SyncUnit's abstract one comes first in the MRO)

    def sync_error(self):
        return "bucket 1 could not be fetched" if self.version != self.pushes[-1] else None


@pytest.mark.parametrize("fails,pushes,failed", [(0, [3], 0), (1, [3, 3], 1)])
def test_a_push_that_fails_once_is_made_again_and_counted(fails, pushes, failed):
    engine = ServedStandIn(fails)
    asyncio.run(engine.sync_weights({"w": 1}, 3))
    assert engine.pushes == pushes and engine.version == 3 and engine.failed_syncs == failed


def test_a_second_failure_in_a_row_stops_the_run():
    engine = ServedStandIn(2)
    with pytest.raises(WeightSyncFailed, match="weights v3 could not reach the vLLM servers twice in a row: bucket 1"):
        asyncio.run(engine.sync_weights({"w": 1}, 3))
    assert engine.pushes == [3, 3] and engine.version == 0


def test_an_engine_with_its_own_weights_updates_in_place_once():
    engine = OwnWeights(1)
    asyncio.run(engine.sync_weights({"w": 1}, 3))
    assert engine.pushes == [3] and engine.failed_syncs == 0  # no protocol: no retry either
