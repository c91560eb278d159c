"""The engine interface the agent loop and the scheduler talk to.

An engine turns a token-id prompt into a completion: token ids, the sampler's log-prob of each,
and why it stopped. Token in, token out: nothing here ever re-tokenizes text. `JaxEngine` (in
process) and the vLLM server engine implement the same members; `load()` is what the scheduler balances on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from rstar2_jax.rollout.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]          # sampler log-prob of each token, at the sampling temperature
    finish_reason: str             # "stop" (a stop string) | "eos" | "length" (max_tokens or context)
    version_start: int = 0         # weights version when the request started ...
    version_end: int = 0           # ... and when it finished (they differ if a sync came mid-turn)
    stop_string: str | None = None


@dataclasses.dataclass(frozen=True)
class ServerLoad:
    """An engine's KV load: from a vLLM server's /metrics (summed over its engine cores), or a
    JaxEngine's slots."""
    kv_usage: float = 0.0           # share of the KV cache in use, 0..1
    kv_capacity_tokens: int = 0     # KV cache size in tokens
    running: int = 0
    waiting: int = 0
    preemptions: int = 0            # since the server started

    @property
    def free_kv_tokens(self) -> int:
        return int(self.kv_capacity_tokens * (1.0 - self.kv_usage))


class Engine(Protocol):
    version: int

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       stop: Sequence[str] = ()) -> Completion: ...

    def update_weights(self, params: Any, version: int | None = None) -> None: ...

    def load(self) -> ServerLoad: ...
