"""The landing gate of sync_wait=export (rollout/engines/background_sync.wait_for_version) on its
own, over stand-in engines: when a step's rollouts may start. The real server's side (held
reloads, deleted arrays, failed reloads) is tests/rollout/test_vllm_engine.py's."""

import asyncio
import concurrent.futures
import dataclasses
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2_jax.rollout.engines.vllm_engine.sync.background import (
    Landing, _publish_verdict, await_landing, settle, wait_for_version)
from rstar2_jax.rollout.engines.base import WeightSyncFailed


@dataclasses.dataclass
class Report:  # the two fields of vllm_engine/sync/report.SyncReport the gate reads
    version: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class StandIn:  # what the gate reads of a VLLMEngine
    version: int
    landing: Landing | None = None
    url: str = "http://stand-in"


def landing(version: int, *errors: str | None) -> Landing:
    """A finished landing whose attempts ended with `errors` (None: landed)."""
    future = concurrent.futures.Future()
    future.set_result([Report(version, e) for e in errors])
    return Landing(version, future)


def gate_returns(engines, version, timeout=0.2) -> bool:
    async def wait():
        try:
            await asyncio.wait_for(wait_for_version(engines, version), timeout)
            return True
        except asyncio.TimeoutError:
            return False
    return asyncio.run(wait())


def test_the_first_sync_is_waited_for_though_the_engine_already_has_its_version_number():
    """An engine starts at version 0 and a run's first sync is version 0 too: the number alone
    would let the first rollouts sample the server's launch weights."""
    pending = Landing(0, concurrent.futures.Future())
    engine = StandIn(0, pending)
    assert not gate_returns([engine], 0)
    pending.future.set_result([Report(0)])
    assert gate_returns([engine], 0)


def test_a_landing_newer_than_the_target_does_not_hold_the_gate_and_one_that_failed_twice_raises():
    assert gate_returns([StandIn(3, Landing(4, concurrent.futures.Future()))], 3)
    assert gate_returns([StandIn(3, landing(3, "refused", None))], 3)  # the second attempt landed
    with pytest.raises(WeightSyncFailed, match="v3 could not reach http://stand-in twice in a row: refused"):
        gate_returns([StandIn(2, landing(3, "refused", "refused"))], 3)


def test_the_gate_waits_for_every_engine_and_wakes_when_the_last_landing_ends():
    first, second = (Landing(5, concurrent.futures.Future()) for _ in range(2))
    engines = [StandIn(4, first), StandIn(4, second)]

    async def main():
        gate = asyncio.ensure_future(wait_for_version(engines, 5))
        for engine, done in zip(engines, (first, second)):
            await asyncio.sleep(0.05)
            assert not gate.done()
            engine.version = 5  # as push_to_servers sets it, then the future ends
            done.future.set_result([Report(5)])
        await asyncio.wait_for(gate, 1.0)
    asyncio.run(main())


@settings(max_examples=200, deadline=None)
@given(versions=st.lists(st.integers(0, 6), min_size=1, max_size=3),
       landings=st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["landed", "failed", "pending", "none"])),
                         min_size=3, max_size=3),
       target=st.integers(0, 6))
def test_the_gate_opens_exactly_when_every_engine_has_the_target_and_nothing_older_is_landing(versions, landings,
                                                                                            target):
    """The law: the gate returns iff each engine samples with `target` or newer and no sync of
    `target` or older is still landing on it (a failed one raises)."""
    engines = []
    for version, (landing_version, state) in zip(versions, landings):
        if state == "landed":
            version = max(version, landing_version)  # a landed sync set the engine's version
        made = {"landed": lambda v: landing(v, None), "failed": lambda v: landing(v, "refused", "refused"),
                "pending": lambda v: Landing(v, concurrent.futures.Future()), "none": lambda v: None}[state]
        engines.append(StandIn(version, made(landing_version)))
    def held(e):  # this engine is not yet on `target`: behind it, or a sync of target or older not landed
        return e.version < target or (e.landing is not None and e.landing.version <= target
                                      and not e.landing.landed())
    if not any(map(held, engines)):
        assert gate_returns(engines, target)
    elif any(held(e) and e.landing is not None and not e.landing.future.done() for e in engines):
        assert not gate_returns(engines, target, timeout=0.02)  # waits for the landing under way
    else:  # nothing under way will bring it: a failed landing, or no sync of it at all
        with pytest.raises((WeightSyncFailed, RuntimeError)):
            gate_returns(engines, target)


@dataclasses.dataclass
class Follower(StandIn):  # what await_landing reads and calls of a VLLMEngine in a process that does not push
    closing: threading.Event = dataclasses.field(default_factory=threading.Event)
    synced: dict | None = None

    def adopt_weights(self, params, version, synced=None):
        assert params is None  # the learner's arrays may be in use again: only the published directories
        self.version, self.synced = version, synced

    def synced_dirs(self):
        return {self.url: f"/exports/v{self.version}"}


def test_a_process_that_does_not_push_takes_a_version_on_only_when_process_0_publishes_that_it_landed():
    """Several trainer processes: process 0 lands each export and publishes the verdict
    (processes.publish: jax.distributed's key-value store; in one process a local one); the
    others wait for it where they need the version, count its failed attempts and take the
    version on with the directory the server reloaded (what restores a restarted server)."""
    url = "http://follower-test"
    follower, pusher = Follower(1, url=url), Follower(2, url=url)
    await_landing([follower], 2)
    assert not gate_returns([follower], 2) and follower.version == 1
    _publish_verdict([pusher], 2, ["refused", None])  # the second attempt landed
    assert gate_returns([follower], 2) and follower.version == 2 and follower.synced == {url: "/exports/v2"}
    assert [r.error for r in settle([follower])] == ["refused", None]

    await_landing([follower], 3)
    _publish_verdict([pusher], 3, ["refused", "refused again"])
    with pytest.raises(WeightSyncFailed, match="v3 could not reach http://follower-test twice in a row: refused again"):
        gate_returns([follower], 3)
    assert follower.version == 2

    await_landing([follower], 4)  # closing: no verdict waited for any more
    follower.closing.set()
    assert [r.error for r in settle([follower])] == ["closed before process 0's verdict came"]
