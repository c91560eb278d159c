"""Host-side bookkeeping of a paged KV cache: which pages are free, and who holds the others.

The device holds the pages (`models.PagedKVCache`); this decides which page each row writes.
Owners are the engine's rows (requests being served) and residents (a finished turn's KV, kept
for the trajectory's next turn until its pages are wanted). Pure Python, no device work, so its
laws are property-tested on their own (tests/rollout/test_kv_pages.py).
"""

from __future__ import annotations

from typing import Hashable


def kv_bytes_per_position(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one position, all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def pages_in_budget(budget_bytes: float, page_size: int, position_bytes: int) -> int:
    """Whole pages of `page_size` positions that fit in `budget_bytes`."""
    return int(budget_bytes // (page_size * position_bytes))


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold positions 0..tokens-1."""
    return -(-tokens // page_size)


class PagePool:
    """A fixed pool of page ids 0..num_pages-1 and their owners.

    Every page is free or held by exactly one owner; an owner's pages are kept in position
    order (its i-th page holds positions i*page_size..). The same calls give the same layout.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._held: dict[Hashable, list[int]] = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def held(self, owner: Hashable) -> list[int]:
        """The owner's pages in position order (a copy; empty if it holds none)."""
        return list(self._held.get(owner, ()))

    def owners(self) -> list[Hashable]:
        return list(self._held)

    def grow(self, owner: Hashable, pages: int) -> None:
        """Give `owner` `pages` more pages at the end of its list."""
        if pages > len(self._free):
            raise MemoryError(f"{pages} pages wanted, {len(self._free)} free")
        if pages > 0:
            self._held.setdefault(owner, []).extend(self._free.pop() for _ in range(pages))

    def transfer(self, owner: Hashable, new_owner: Hashable) -> None:
        """Hand every page of `owner` to `new_owner` (which must hold none), order kept."""
        if new_owner in self._held:
            raise ValueError(f"{new_owner!r} already holds pages")
        if owner in self._held:
            self._held[new_owner] = self._held.pop(owner)

    def truncate(self, owner: Hashable, keep: int) -> None:
        """Free the owner's pages past the first `keep`."""
        pages = self._held.get(owner, [])
        while len(pages) > keep:
            self._free.append(pages.pop())
        if not pages:
            self._held.pop(owner, None)

    def release(self, owner: Hashable) -> int:
        """Free every page of `owner`; how many there were."""
        pages = self._held.pop(owner, [])
        self._free.extend(reversed(pages))
        return len(pages)
