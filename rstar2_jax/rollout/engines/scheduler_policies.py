"""The scheduler's placement policies: pure functions of the engines' loads (no I/O), shared by
the Scheduler, the config check (`rollout.vllm.scheduler` names one) and the simulation benchmark.
rollout/scheduler.py describes each policy and prefix affinity."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from rstar2_jax.core.registry import Registry

Policy = Callable[[Sequence["EngineLoad"], int, int], "int | None"]


@dataclasses.dataclass
class EngineLoad:
    """One engine as a policy sees it."""
    capacity_tokens: int
    reserved_tokens: int = 0     # sum of the reservations of our requests in flight there
    used_tokens: int = 0         # KV in use as the engine last reported it
    in_flight: int = 0           # our requests in flight there
    healthy: bool = True

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - max(self.reserved_tokens, self.used_tokens)


def pick_kv_aware(loads: Sequence[EngineLoad], need: int, turn: int) -> int | None:
    """The healthy engine with the most free KV that fits `need` tokens; None: wait.

    A request larger than every engine's whole capacity could never fit: it goes to an idle
    engine (where it runs alone) rather than waiting forever."""
    fits = [i for i, l in enumerate(loads) if l.healthy and l.free_tokens >= need]
    if fits:
        return max(fits, key=lambda i: (loads[i].free_tokens, -i))
    if all(need > l.capacity_tokens for l in loads if l.healthy):
        idle = [i for i, l in enumerate(loads) if l.healthy and l.in_flight == 0]
        return idle[0] if idle else None
    return None


def pick_round_robin(loads: Sequence[EngineLoad], need: int, turn: int) -> int | None:
    healthy = [i for i, l in enumerate(loads) if l.healthy]
    return healthy[turn % len(healthy)] if healthy else None


def pick_least_requests(loads: Sequence[EngineLoad], need: int, turn: int) -> int | None:
    healthy = [i for i, l in enumerate(loads) if l.healthy]
    return min(healthy, key=lambda i: (loads[i].in_flight, i)) if healthy else None


POLICIES: Registry[Policy] = Registry("scheduler policy")
POLICIES.register("kv_aware", pick_kv_aware)
POLICIES.register("round_robin", pick_round_robin)
POLICIES.register("least_requests", pick_least_requests)


def pick_with_affinity(pick: Callable[[Sequence[EngineLoad], int, int], int | None], loads: Sequence[EngineLoad],
                       need: int, turn: int, home: int | None) -> int | None:
    """`home` (the engine holding the trajectory's prefix) when it is healthy and `need` fits
    there; otherwise whatever `pick` decides."""
    if home is not None and loads[home].healthy and loads[home].free_tokens >= need:
        return home
    return pick(loads, need, turn)


def reservation(prompt_len: int, max_tokens: int, reserve_new_tokens: int | None) -> int:
    """KV tokens a turn may come to hold: its prompt plus the new tokens it is allowed (or fewer,
    when `reserve_new_tokens` bets on shorter answers and accepts some risk of preemption)."""
    new = max_tokens if reserve_new_tokens is None else min(max_tokens, reserve_new_tokens)
    return prompt_len + new
