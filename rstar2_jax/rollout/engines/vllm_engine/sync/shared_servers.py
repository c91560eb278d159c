"""The sync onto servers that every trainer process shares (vLLM): one process pushes, the
others take part in the export's collectives and take the version on only once the primary says
it landed, so no token is stamped with a version its server does not have yet.

A `SyncUnit` is what takes one sync: a VLLMEngine (vllm_engine/sync/server_steps.py), or servers
that read one export (shared_export.py). `sync_shared` is the protocol over the units' methods;
nothing outside the vLLM engine knows it (the Engine interface is `sync_weights`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import Any, Callable

from rstar2_jax.core import processes
from rstar2_jax.rollout.engines.base import WeightSyncFailed

log = logging.getLogger(__name__)


class SyncUnit(abc.ABC):
    """The sync side of servers every process shares. `update_weights` pushes (the primary);
    the defaults are those of a unit with nothing to add."""

    version: int = 0
    given_version: int = 0
    failed_syncs: int = 0  # versions whose push failed part-way (each made again)

    async def sync_weights(self, params: Any, version: int) -> None:
        """The trainer's call after every update, on every process (the protocol: sync_shared)."""
        self.given_version = version
        await sync_shared(self, params, version)

    @abc.abstractmethod
    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Push `params` as `version` to the servers (the primary; with `lands_in_background`
        returns once they are exported)."""

    # True when a push returns once the weights are exported, and the servers' reload lands
    # behind the trainer (rollout.vllm.sync_wait=export: vllm_engine/sync/background.py).
    lands_in_background: bool = False

    def adopt_weights(self, params: Any, version: int, synced: dict[str, str] | None = None) -> None:
        """Another process pushed `params` as `version` to the servers: take the version on
        (`synced`: the directory each server reloaded them from, by URL)."""
        self.version = version

    def take_part_in_sync(self, params: Any) -> None:
        """While another process pushes `params` (split over processes): the same collectives."""
        return None

    def synced_dirs(self) -> dict[str, str]:
        """Where each server (by URL) reloaded its current weights from, for the other processes."""
        return {}

    def sync_error(self) -> str | None:
        """Why the last push did not land (None: it did, or nothing to say)."""
        return None

    def export_error(self) -> str | None:
        """The last background sync's export failed before it was whole: why (None: it was whole)."""
        return None

    def expect_landing(self, params: Any, version: int) -> None:
        """A process that does not push, once the export of `version` (of `params`) was whole: the
        primary lands it behind; the version is taken on when its verdict comes
        (background.await_landing), which `weights_at_least` waits for."""
        self.adopt_weights(params, version)

    def settle_sync(self) -> list[str | None]:
        """Wait for the background sync under way, if any: each of its attempts' error (None:
        landed); empty when none was started."""
        return []


async def sync_shared(unit: SyncUnit, params: Any, version: int) -> None:
    """Every process: the primary pushes on a worker thread (rollouts in flight go on meanwhile),
    the others take part in the export's gathers, then adopt the version the primary landed. A
    sync that failed part-way (the servers were rolled back to their previous weights) is made
    once more, counted in `failed_syncs`; a second failure raises WeightSyncFailed. A unit that
    `lands_in_background` returns once the weights are exported."""
    if unit.lands_in_background:
        await _sync_in_background(unit, params, version)
        return
    synced = await _push_in_step(unit, params, version,
                                 lambda: (unit.version == version, unit.synced_dirs(), unit.sync_error()))
    if not processes.is_primary():
        unit.adopt_weights(params, version, synced)


async def _push_in_step(unit: SyncUnit, params: Any, version: int,
                        outcome: Callable[[], tuple[bool, dict[str, str], str | None]]) -> dict[str, str]:
    """Every process: the primary pushes, the others take part in the export's gathers (the
    parameters may be split over processes); then `outcome()`, the primary's (done, the
    directory each server reloaded, error), is shared (also the barrier). A failed attempt is
    counted and made once more; a second raises WeightSyncFailed. Returns the directories."""
    primary = processes.is_primary()
    for attempt in (1, 2):
        if primary:
            await asyncio.to_thread(unit.update_weights, params, version)
        else:
            await asyncio.to_thread(unit.take_part_in_sync, params)
        done, synced, error = processes.gather_shares([outcome()] if primary else [], 1)[0]
        if done:
            return synced
        unit.failed_syncs += 1
        log.warning("weights v%d did not reach the servers (%s)%s", version, error,
                    "; syncing again" if attempt == 1 else "")
    raise WeightSyncFailed(f"weights v{version} could not reach the vLLM servers twice in a row: {error} "
                           "(the servers answer with their previous weights; see the trainer's and servers' "
                           "logs)")


async def _sync_in_background(unit: SyncUnit, params: Any, version: int) -> None:
    """The previous sync settled (its failed attempts counted; two in a row raise), then this
    one started: returns once the learner's arrays are free, before the servers have it.
    Several processes: the export is made in step by all (its gathers need every process),
    and again by all when it failed before it was whole; the primary's landing then goes on
    behind, and the others wait for its verdict where they need the version."""
    errors = await asyncio.to_thread(unit.settle_sync)  # others: the primary's verdict on the last one
    for attempt, error in enumerate(errors, 1):
        if error is not None:
            unit.failed_syncs += 1
            log.warning("the last weights did not reach the servers (%s)%s", error,
                        "; made again from their export" if attempt == 1 and len(errors) > 1 else "")
    if len(errors) > 1 and errors[-1] is not None:
        raise WeightSyncFailed(f"the weights before v{version} could not reach the vLLM servers twice in a row: "
                               f"{errors[-1]} (the servers answer with their previous weights; see the trainer's "
                               "and servers' logs)")
    if processes.count() == 1:
        await asyncio.to_thread(unit.update_weights, params, version)
        return

    def exported() -> tuple[bool, dict[str, str], str | None]:  # the landing goes on behind
        error = unit.export_error()
        return error is None, {}, error

    await _push_in_step(unit, params, version, exported)
    if not processes.is_primary():
        unit.expect_landing(params, version)
