"""The engine interface the agent loop and the scheduler talk to.

An engine turns a token-id prompt into a completion: token ids, the sampler's log-prob of each,
and why it stopped. Token in, token out: nothing here ever re-tokenizes text. `JaxEngine` (in
process), `VLLMEngine` (a client of a vLLM server) and the `Scheduler` (several engines behind
one) all derive from `Engine`, which declares everything a caller may use: the trainer, the
evaluation and the agent loop never probe an engine for optional members.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Hashable, Protocol, Sequence

from rstar2_jax.rollout.engines.sampling import SamplingParams


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


def checked_prompt(prompt_ids: Sequence[int], max_tokens: int, max_len: int | None) -> tuple[list[int], int]:
    """Every engine's `generate` prologue: the prompt as ints and the tokens it may still sample
    (`max_tokens`, cut to what `max_len` leaves; None: the engine knows no limit). Raises
    ValueError for an empty prompt and PromptTooLong for one longer than `max_len`; a budget of
    0 is the caller's `empty_completion`."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if max_len is None:
        return prompt, max_tokens
    if len(prompt) > max_len:
        raise PromptTooLong(len(prompt), max_len)
    return prompt, min(max_tokens, max_len - len(prompt))


def empty_completion(version: int) -> Completion:
    """A turn with no room to sample: nothing, stopped by length."""
    return Completion([], [], "length", version, version)


class SyncTarget(Protocol):
    """What a scheduler's sync updates: an engine, or engines that take one sync together."""
    failed_syncs: int

    async def sync_weights(self, params: Any, version: int) -> None: ...

    def update_weights(self, params: Any, version: int | None = None) -> None: ...


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

    # True when the weights live on servers that every trainer process shares (vLLM: one process
    # pushes, the others take the version on; vllm_engine/sync/shared_servers.py).
    weights_on_servers: bool = False

    async def sync_weights(self, params: Any, version: int) -> None:
        """Sample with `params` as `version` from now on: what the trainer calls after every
        update, on every trainer process. An engine whose weights are its own updates in place;
        engines on servers every process shares run their own protocol (VLLMEngine: the primary
        pushes, the others adopt; a sync that failed part-way is made once more and counted in
        `failed_syncs`, a second failure raises WeightSyncFailed)."""
        self.given_version = version
        self.update_weights(params, version)

    @classmethod
    def sync_units(cls, engines: Sequence["Engine"]) -> Sequence[SyncTarget]:
        """`engines` (all of this class, behind one scheduler) as what a sync updates: each engine
        alone, unless the class's engines take one sync together (vLLM servers reading one
        export: vllm_engine/sync/shared_export.py)."""
        return list(engines)

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
        alone: the trainer calls `sync_weights`)."""

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
