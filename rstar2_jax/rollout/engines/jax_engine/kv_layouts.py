"""Where the JaxEngine's KV lives: one max_len row per slot (SlotRows) or a pool of pages with a
table per slot (PagedKV). The engine (jax_engine/engine.py) schedules requests and keeps the residents
(a finished turn's KV, kept for the trajectory's next turn); a layout answers what depends on
where the KV is: the cache it allocates, whether a request's prompt fits, which slot it gets,
what a prefill and a decode step are given, and what happens to a row's KV when its request
ends, is preempted or becomes a resident. One object, chosen once, instead of a branch on
`paged` in every scheduling step.
"""

from __future__ import annotations

from typing import Hashable, Protocol

import numpy as np

from rstar2_jax.models.kv_cache import init_cache, init_paged_cache
from rstar2_jax.rollout.engines.jax_engine.kv_pages import PagePool, pages_for
from rstar2_jax.rollout.engines.jax_engine.slot_requests import Request, Resident, SlotOwner


class KVLayout(Protocol):
    paged: bool
    cache_axes: tuple  # logical axes of one layer's keys (and values): how a mesh splits them

    def make_cache(self, cfg, dtype): ...
    def load(self, busy: int) -> tuple[float, int]: ...
    def make_room(self, engine: SlotOwner, req: Request, resident: Resident | None) -> bool: ...
    def choose_slot(self, engine: SlotOwner, free: list[int], resident: Resident | None) -> int: ...
    def drop_resident(self, session: Hashable) -> None: ...
    def take_resident(self, session: Hashable, slot: int) -> None: ...
    def prefill(self, kernels, slot: int, context_len: int, reuse: int): ...
    def before_decode(self, engine: SlotOwner, lookahead: int = 1) -> None: ...
    def decode_table(self, active_slots: list[int | None]): ...
    def keep(self, slot: int, session: Hashable, tokens: list[int]) -> int | None: ...
    def free_row(self, slot: int) -> None: ...
    def idle_prefill(self, kernels): ...


class SlotRows:
    """A [slots, max_len] cache: slot i writes row i. A resident stays in its slot's row until
    the slot is needed (other requests take empty slots first, then the least recently used)."""

    paged = False
    cache_axes = (None, "kv_heads", None, None)

    def __init__(self, slots: int, max_len: int):
        self.slots, self.max_len = slots, max_len

    def make_cache(self, cfg, dtype):
        return init_cache(cfg, self.slots, self.max_len, dtype=dtype)

    def load(self, busy: int) -> tuple[float, int]:
        """(usage, capacity in tokens): every slot owns a max_len row; a busy slot uses all of it."""
        return busy / self.slots, self.slots * self.max_len

    def make_room(self, engine, req, resident) -> bool:
        return True  # a free slot is a free row

    def choose_slot(self, engine, free, resident) -> int:
        """The slot holding the reused KV, else an empty one, else the one whose resident was used
        least recently (it is dropped)."""
        if resident is not None and resident.slot in free:
            return resident.slot
        held = {r.slot: session for session, r in engine.residents.items()}
        empty = [i for i in free if i not in held]
        if empty:
            return empty[0]
        oldest = min(free, key=lambda i: engine.residents[held[i]].last_used)
        engine.drop_resident(held[oldest])
        return oldest

    def drop_resident(self, session) -> None:
        pass  # its row is simply overwritten by the slot's next request

    def take_resident(self, session, slot) -> None:
        pass  # its KV is in `slot`'s row already (choose_slot gave the request that slot)

    def prefill(self, kernels, slot, context_len, reuse):
        """(kernel, where it writes: after the weights and the cache): a fresh row, or new tokens
        after the row's KV."""
        return (kernels.extend if reuse else kernels.prefill), np.int32(slot)

    def before_decode(self, engine, lookahead: int = 1) -> None:
        pass  # every row is max_len long already

    def decode_table(self, active_slots):
        return None

    def keep(self, slot, session, tokens) -> int | None:
        """A finished turn's KV stays in the slot's row: the resident's slot."""
        return slot

    def free_row(self, slot) -> None:
        pass

    def idle_prefill(self, kernels):
        """A prefill kernel and where it writes: slot 0 (precompile)."""
        return kernels.prefill, np.int32(0)


class PagedKV:
    """A pool of `kv_pages` pages of `page_size` positions; each slot a page table. Memory follows
    the tokens written, so more slots than max_len rows would fit can be served. A decode step that
    needs a page when none is free takes one from a resident, else preempts the most recently
    admitted request (vLLM's preemption by recompute). A resident keeps only its pages, whichever
    slot the next turn lands in."""

    paged = True
    cache_axes = ("kv_heads", None, None, None)

    def __init__(self, slots: int, max_len: int, page_size: int, kv_pages: int | None):
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.pages_per_row = max_len // page_size
        kv_pages = slots * self.pages_per_row if kv_pages is None else kv_pages
        if kv_pages < self.pages_per_row:
            raise ValueError(f"kv_pages={kv_pages} cannot hold one max_len={max_len} sequence "
                             f"({self.pages_per_row} pages of {page_size})")
        self.pool = PagePool(kv_pages)

    def make_cache(self, cfg, dtype):
        return init_paged_cache(cfg, self.pool.num_pages, self.page_size, dtype=dtype)

    def load(self, busy: int) -> tuple[float, int]:
        """(usage, capacity in tokens): the pages requests hold (residents' are free to take)."""
        held = sum(len(self.pool.held(("row", i))) for i in range(self.slots))
        return held / self.pool.num_pages, self.pool.num_pages * self.page_size

    def make_room(self, engine, req, resident) -> bool:
        """Free pages for `req`'s context (past what `resident` holds), evicting other residents
        least recently used first; False (nothing evicted) if it cannot fit yet."""
        held = len(self.pool.held(("resident", req.session))) if resident is not None else 0
        needed = pages_for(len(req.context()), self.page_size) - held
        evictable = sorted((r.last_used, s) for s, r in engine.residents.items() if r is not resident)
        if needed > self.pool.free + sum(len(self.pool.held(("resident", s))) for _, s in evictable):
            return False
        for _, session in evictable:
            if self.pool.free >= needed:
                break
            engine.drop_resident(session)
        return True

    def choose_slot(self, engine, free, resident) -> int:
        return free[0]  # the KV is in pages, not in a slot

    def drop_resident(self, session) -> None:
        self.pool.release(("resident", session))

    def take_resident(self, session, slot) -> None:
        self.pool.transfer(("resident", session), ("row", slot))  # its pages become the row's

    def prefill(self, kernels, slot, context_len, reuse):
        """The row grows to the context; the kernel writes through the row's page table."""
        self.pool.grow(("row", slot), pages_for(context_len, self.page_size) - len(self.pool.held(("row", slot))))
        return kernels.fill_pages, self.table([slot])  # NumPy: the kernel takes it as it is

    def before_decode(self, engine, lookahead: int = 1) -> None:
        """Give every row the pages its next `lookahead` writes land in (at most its remaining
        budget; more than one for chunked decode), oldest admission first. When none is free, evict
        a resident, else preempt the most recently admitted request."""
        active = engine.active
        for slot in sorted((i for i, r in enumerate(active) if r is not None), key=lambda i: active[i].admitted):
            req = active[slot]
            if req is None:  # preempted while an older row grew
                continue
            position = len(req.context()) - 1 + max(1, min(lookahead, engine.remaining(req))) - 1
            while len(self.pool.held(("row", slot))) <= position // self.page_size:
                if self.pool.free:
                    self.pool.grow(("row", slot), 1)
                elif engine.residents:
                    engine.drop_resident(min(engine.residents, key=lambda s: engine.residents[s].last_used))
                else:
                    victim = max((i for i, r in enumerate(active) if r is not None), key=lambda i: active[i].admitted)
                    engine.preempt(victim)
                    if victim == slot:
                        break

    def table(self, slots) -> np.ndarray:
        """Page tables of `slots` (None: an idle row), unallocated entries = num_pages."""
        table = np.full((len(slots), self.pages_per_row), self.pool.num_pages, np.int32)
        for row, slot in enumerate(slots):
            if slot is not None:
                pages = self.pool.held(("row", slot))
                table[row, :len(pages)] = pages
        return table

    def decode_table(self, active_slots):
        return self.table(active_slots)

    def keep(self, slot, session, tokens) -> int | None:
        """The finished turn's pages (those its tokens fill) go to the resident; the rest are freed."""
        self.pool.truncate(("row", slot), pages_for(len(tokens), self.page_size))
        self.pool.transfer(("row", slot), ("resident", session))
        return None

    def free_row(self, slot) -> None:
        self.pool.release(("row", slot))

    def idle_prefill(self, kernels):
        """A paged fill through an all-"no page" table: every write dropped (precompile)."""
        return kernels.fill_pages, self.table([None])
