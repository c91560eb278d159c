"""The JaxEngine's requests and residents (`Request`, `Resident`), and what its strategies may ask
of it: a KV layout (jax_engine/kv_layouts.py) sees a `SlotOwner`, a decode loop (jax_engine/decode_step.py,
jax_engine/decode_chunks.py) a `DecodeHost`. The engine (jax_engine/engine.py) is both; the strategies import this
module, never the engine, so each can be read, tested and replaced on its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Hashable, Mapping, Protocol

from rstar2_jax.rollout.engines.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    prompt: list[int]
    sampling: SamplingParams
    stops: tuple[str, ...]
    future: asyncio.Future
    version_start: int = 0
    seed: int = 0                  # token i is sampled with fold_in(key(seed), i)
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # weights that sampled each token
    kv_versions: list[int] = dataclasses.field(default_factory=list)  # oldest weights in the KV each token read
    kv_version: int = 0            # weights of the latest (re)admission's prefill: the oldest KV in the row
    session: Hashable | None = None
    admitted: int = -1             # admission counter at its (latest) admission: preemption takes the newest
    owner: Hashable | None = None  # whose work it is (accounting.py: the RL step it belongs to)

    def context(self) -> list[int]:
        """The tokens whose KV the request's row holds before its next sample (all but the
        last sampled token, which the next decode step feeds), or must prefill on readmission."""
        return self.prompt + self.generated


@dataclasses.dataclass
class Resident:
    """A finished turn's KV, kept for the same trajectory's next turn."""
    tokens: list[int]              # the tokens whose KV is held, in order
    version: int                   # weights that computed it
    last_used: int                 # admission counter, for least-recently-used eviction
    slot: int | None = None        # slot rows: the row that holds it (paged: its pages, owner ("resident", session))


class SlotOwner(Protocol):
    """What a KV layout asks of the engine: the request in each slot, the residents, and the two
    ways to free KV (drop a resident, preempt a request)."""
    active: list[Request | None]             # the request decoding in each slot (None: free)
    residents: Mapping[Hashable, Resident]   # finished turns' KV kept, by session

    def drop_resident(self, session: Hashable) -> None: ...
    def preempt(self, slot: int) -> None: ...
    def remaining(self, req: Request) -> int: ...


class DecodeHost(SlotOwner, Protocol):
    """What a decode loop asks of the engine: the kernels and their arguments (the live weights'
    state, the cache it replaces after each call), the worker thread device work runs on, and
    where sampled tokens go (`append`) and are accounted."""
    slots: int
    max_len: int
    kernels: Any         # jax_kernels.EngineKernels
    kv: Any              # the KV layout (kv_layouts.KVLayout)
    stats: Any           # base.EngineStats
    ledger: Any          # accounting.OwnerLedger
    cache: Any
    executor: concurrent.futures.Executor

    @property
    def version(self) -> int: ...
    @property
    def state(self) -> Any: ...
    def append(self, slot: int, token: int, logp: float, version: int) -> None: ...
    def device_stop_ids(self, req: Request) -> tuple[int, ...]: ...


