"""The engine interface the agent loop and the scheduler talk to.

An engine turns a token-id prompt into a completion: token ids, the sampler's log-prob of each,
and why it stopped. Token in, token out: nothing here ever re-tokenizes text. `JaxEngine` (in
process), `VLLMEngine` (a client of a vLLM server) and the `Scheduler` (several engines behind
one) all derive from `Engine`, which declares everything a caller may use: the trainer, the
evaluation and the agent loop never probe an engine for optional members.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from typing import Any, Callable, Hashable, Sequence

from rstar2_jax.core import processes
from rstar2_jax.rollout.engines.sampling import SamplingParams

log = logging.getLogger(__name__)


class WeightSyncFailed(RuntimeError):
    """A version could not reach the shared servers twice in a row (they answer with their
    previous weights)."""


class EngineUnavailable(ConnectionError):
    """The engine cannot take requests now (a server down past its restart timeout): a scheduler
    sends the request to another engine."""


class PromptTooLong(ValueError):
    """A request's prompt is longer than the engine's context: that request fails, the engine goes
    on serving the others. (A prompt that fits but leaves no room to sample ends "length": the
    agent loop's later turns meet that as a full context, not as an error.)"""

    def __init__(self, prompt_len: int, max_len: int):
        super().__init__(f"a prompt of {prompt_len} tokens does not fit the engine's context of {max_len} "
                         f"(rollout.max_len): shorten it or raise max_len")


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]          # sampler log-prob of each token, at the sampling temperature
    finish_reason: str             # "stop" (a stop string) | "eos" | "length" (max_tokens or context)
    version_start: int = 0         # weights version when the request started ...
    version_end: int = 0           # ... and when it finished (they differ if a sync came mid-turn)
    stop_string: str | None = None
    # The weights version that sampled each token. Engines that swap weights between decode steps
    # (partial rollouts) know it exactly; empty means every token is counted as version_start,
    # the oldest weights that can have sampled it (a safe bound for the staleness check).
    token_versions: tuple[int, ...] = ()
    # The oldest weights version whose KV each token's sampling attended to: a partial rollout
    # keeps the KV computed before a swap, so a token sampled by new weights can still read keys
    # and values of old ones. Empty: version_start for every token (vLLM keeps KV across a sync:
    # pause(mode="keep"); the turn's start is the oldest weights that can have computed it).
    token_kv_versions: tuple[int, ...] = ()

    def versions(self) -> list[int]:
        """Per-token weights versions (see token_versions)."""
        return list(self.token_versions) if self.token_versions else [self.version_start] * len(self.token_ids)

    def kv_versions(self) -> list[int]:
        """Per-token oldest KV versions (see token_kv_versions)."""
        return (list(self.token_kv_versions) if self.token_kv_versions
                else [self.version_start] * len(self.token_ids))


@dataclasses.dataclass(frozen=True)
class ServerLoad:
    """An engine's KV load: from a vLLM server's /metrics (summed over its engine cores), or a
    JaxEngine's slots."""
    kv_usage: float = 0.0           # share of the KV cache in use, 0..1
    kv_capacity_tokens: int = 0     # KV cache size in tokens
    running: int = 0
    waiting: int = 0
    preemptions: int = 0            # since the server started
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache, since the server started ...
    prefix_cache_hits: int = 0      # ... and how many of them were found there

    @property
    def free_kv_tokens(self) -> int:
        return int(self.kv_capacity_tokens * (1.0 - self.kv_usage))


@dataclasses.dataclass
class EngineStats:
    """Where an in-process engine's time went (device work, measured around each jitted call)."""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    busy_slot_steps: int = 0     # sum over decode steps of the slots that held a request
    slots: int = 1
    prefill_tokens: int = 0      # prompt tokens run through the model at admission
    reused_tokens: int = 0       # prompt tokens whose KV the engine still held from the previous turn
    preemptions: int = 0         # requests whose KV was freed for others' (paged KV), recomputed on readmission
    own_slot_steps: int = 0      # per owner (accounting.py): the slot-steps its own requests held

    @property
    def slot_utilization(self) -> float:
        """Share of decode-step slots that did useful work (1.0: every slot busy every step)."""
        return self.busy_slot_steps / max(1, self.decode_steps * self.slots)

    def since(self, before: "EngineStats") -> "EngineStats":
        """What happened between `before` (a copy taken earlier) and now."""
        return EngineStats(self.prefill_s - before.prefill_s, self.decode_s - before.decode_s,
                           self.decode_steps - before.decode_steps, self.busy_slot_steps - before.busy_slot_steps,
                           self.slots, self.prefill_tokens - before.prefill_tokens,
                           self.reused_tokens - before.reused_tokens, self.preemptions - before.preemptions,
                           self.own_slot_steps - before.own_slot_steps)


class Engine(abc.ABC):
    """A rollout engine; use it as `async with engine:` (closing frees threads, servers' sync
    directories, device loops)."""

    version: int = 0                    # version of the weights it samples with
    given_version: int = 0              # the newest version given to sync_weights (it may still be landing)
    stats: EngineStats | None = None    # device-time accounting, where the engine can measure it
    failed_syncs: int = 0               # versions whose push to shared servers failed part-way (each made again)

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = (), *, session: Hashable | None = None) -> Completion:
        """One turn: sample after `prompt_ids` until a stop string, EOS or max_tokens. `session`
        names the trajectory the turn belongs to (its turns share a growing prefix): a scheduler
        keeps a session on the engine that holds that prefix; single engines ignore it."""

    # True when the weights live on servers that every trainer process shares (vLLM): one process
    # pushes them (update_weights), the others only adopt the new version (adopt_weights).
    weights_on_servers: bool = False

    async def sync_weights(self, params: Any, version: int) -> None:
        """Sample with `params` as `version` from now on: what the trainer calls after every
        update, on every trainer process. An engine whose weights are its own updates in place.
        Weights on shared servers (vLLM) are pushed by the primary process alone, on a worker
        thread (rollouts in flight go on meanwhile), while the others take part in the export's
        gathers; the primary then tells them whether the sync landed, and they take the version
        on only then, so no token is stamped with a version its server does not have yet. A
        sync that failed part-way (the servers were rolled back to their previous weights) is
        made once more, counted in `failed_syncs`; a second failure raises WeightSyncFailed. An
        engine that `lands_in_background` (rollout.vllm.sync_wait=export, one process) returns
        once the weights are exported; `weights_at_least` then waits for them to land."""
        self.given_version = version
        if not self.weights_on_servers:
            self.update_weights(params, version)
            return
        if self.lands_in_background:  # the reload lands behind (vllm_engine/sync/background.py)
            await self._sync_in_background(params, version)
            return
        synced = await self._push_in_step(params, version,
                                          lambda: (self.version == version, self.synced_dirs(), self.sync_error()))
        if not processes.is_primary():
            self.adopt_weights(params, version, synced)

    async def _push_in_step(self, params: Any, version: int,
                            outcome: Callable[[], tuple[bool, dict[str, str], str | None]]) -> dict[str, str]:
        """Every process: the primary pushes, the others take part in the export's gathers (the
        parameters may be split over processes); then `outcome()`, the primary's (done, the
        directory each server reloaded, error), is shared (also the barrier). A failed attempt is
        counted and made once more; a second raises WeightSyncFailed. Returns the directories."""
        primary = processes.is_primary()
        for attempt in (1, 2):
            if primary:
                await asyncio.to_thread(self.update_weights, params, version)
            else:
                await asyncio.to_thread(self.take_part_in_sync, params)
            done, synced, error = processes.gather_shares([outcome()] if primary else [], 1)[0]
            if done:
                return synced
            self.failed_syncs += 1
            log.warning("weights v%d did not reach the servers (%s)%s", version, error,
                        "; syncing again" if attempt == 1 else "")
        raise WeightSyncFailed(f"weights v{version} could not reach the vLLM servers twice in a row: {error} "
                               "(the servers answer with their previous weights; see the trainer's and servers' "
                               "logs)")

    # True when a push to shared servers returns once the weights are exported, and the servers'
    # reload lands behind the trainer (rollout.vllm.sync_wait=export: vllm_engine/sync/background.py).
    lands_in_background: bool = False

    async def _sync_in_background(self, params: Any, version: int) -> None:
        """The previous sync settled (its failed attempts counted; two in a row raise), then this
        one started: returns once the learner's arrays are free, before the servers have it.
        Several processes: the export is made in step by all (its gathers need every process),
        and again by all when it failed before it was whole; the primary's landing then goes on
        behind, and the others wait for its verdict where they need the version."""
        errors = await asyncio.to_thread(self.settle_sync)  # others: the primary's verdict on the last one
        for attempt, error in enumerate(errors, 1):
            if error is not None:
                self.failed_syncs += 1
                log.warning("the last weights did not reach the servers (%s)%s", error,
                            "; made again from their export" if attempt == 1 and len(errors) > 1 else "")
        if len(errors) > 1 and errors[-1] is not None:
            raise WeightSyncFailed(f"the weights before v{version} could not reach the vLLM servers twice in a row: "
                                   f"{errors[-1]} (the servers answer with their previous weights; see the trainer's "
                                   "and servers' logs)")
        if processes.count() == 1:
            await asyncio.to_thread(self.update_weights, params, version)
            return
        def exported() -> tuple[bool, dict[str, str], str | None]:  # the landing goes on behind
            error = self.export_error()
            return error is None, {}, error

        await self._push_in_step(params, version, exported)
        if not processes.is_primary():
            self.expect_landing(params, version)

    @classmethod
    def sync_units(cls, engines: Sequence["Engine"]) -> list:
        """`engines` (all of this class, behind one scheduler) as the units a sync updates, each
        with this class's sync methods (update_weights, adopt_weights, expect_landing, settle_sync,
        export_error, take_part_in_sync, lands_in_background): each engine alone, unless the
        class's engines share one sync (vLLM servers reading one export: vllm_engine/sync/shared_export.py)."""
        return list(engines)

    def export_error(self) -> str | None:
        """The last background sync's export failed before it was whole: why (None: it was whole)."""
        return None

    def expect_landing(self, params: Any, version: int) -> None:
        """A process that does not push, once the export of `version` (of `params`) was whole: the
        primary lands it behind; this engine takes the version on when its verdict comes
        (background_sync.await_landing), which `weights_at_least` waits for."""
        self.adopt_weights(params, version)

    def settle_sync(self) -> list[str | None]:
        """Wait for the background sync under way, if any: each of its attempts' error (None:
        landed); empty when none was started."""
        return []

    async def weights_at_least(self, version: int) -> None:
        """Until this engine samples with `version` or newer weights (a background sync landed:
        what a step's rollouts wait for). Engines whose syncs land before returning: at once."""
        return None

    async def latest_landed(self) -> None:
        """Until the newest weights given to sync_weights sample (the trainer's promise to a
        step's rollouts and to an evaluation: they see the last update, landed)."""
        await self.weights_at_least(self.given_version)

    @abc.abstractmethod
    def update_weights(self, params: Any, version: int | None = None) -> None:
        """Sample with `params` (an nnx.State of the model's Params) from now on (this process
        alone: the trainer calls `sync`)."""

    def adopt_weights(self, params: Any, version: int, synced: dict[str, str] | None = None) -> None:
        """Another process pushed `params` as `version` to the servers this engine shares: take
        the version on (`synced`: the directory each server reloaded them from, by URL). Engines
        whose weights are their own just update."""
        self.update_weights(params, version)

    def take_part_in_sync(self, params: Any) -> None:
        """While another process pushes `params` (split over processes) to shared servers: the
        same collectives. Engines whose weights are their own take no part."""
        return None

    def synced_dirs(self) -> dict[str, str]:
        """Where each server (by URL) reloaded its current weights from, for the other processes."""
        return {}

    def sync_error(self) -> str | None:
        """Why the last push to shared servers did not land (None: it did, or nothing to say)."""
        return None

    def sync_paused_s(self) -> float | None:
        """The longest time a shared server stopped generating during the last push from this
        process (None: no push from here, or no servers)."""
        return None

    @abc.abstractmethod
    def load(self) -> ServerLoad:
        """KV load, what the scheduler balances on."""

    def take_owned(self, owner: Hashable):
        """The work done for `owner`'s requests since the last call (accounting.OwnedWork), then
        forgotten; None for an engine that does not account per owner."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what the engine holds; idempotent."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
