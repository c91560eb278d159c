"""Packing: the rows of an update placed into token-budgeted packed rows, and back.

Padded rows (batching.py) are as wide as the longest rollout; agentic rollouts have a long
tail, so most of a padded rectangle is padding (45% real tokens on the demo's traces). Packed,
each rollout keeps its own tokens, positions restarting at 0 and a segment id (1, 2, ... in its
packed row; 0 is padding), and the decoder attends within a segment only. A packed row holds
at most `budget` positions (verl's `ppo_max_token_len_per_gpu` with `use_dynamic_bsz`). The plan
opens as few rows as the tokens and the segment bound allow (a multiple of `width`, the devices a
micro-batch splits over), balances the rollouts over them (longest first, each to the least-filled
row it fits), and groups the rows `width` at a time, fullest first, into micro-batches, each cut to
its fullest row (rounded up on a grid of 32 lengths per octave: <= 3.1% more, few compiled shapes).
So the number of micro-batches and their length follow from the tokens, not a setting, and a small
update at a large budget computes about its tokens, not a whole row (issue 70: 3.69 positions per
real token before, on the demo's traces at a budget of 32,768).

Only the model's passes run packed. Everything else keeps the padded layout [N, T] it has
always had: `PackingPlan.pack` moves a per-token [N, T] (or per-row [N]) array into the packed
layout, `unpack` brings packed per-token values back (as verl's remove-padding pads log-probs
back to [batch, seq]). The plan is a pure function of the rows' lengths: every process of a
multi-process learner builds the same plan from the same batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """Where each of N padded rows lies in `rows` packed rows of at most `budget` positions.

    packed_row[i], offset[i]: rollout i's first token; length[i]: its tokens (0: a padding row,
    not placed, packed_row -1). rows is a multiple of `width`; micro-batch k is rows
    [k * width, (k + 1) * width), computed over `positions[k]` positions (its fullest row, rounded
    up: `shape_length`)."""
    budget: int
    width: int
    rows: int
    packed_row: np.ndarray   # int [N]
    offset: np.ndarray       # int [N]
    length: np.ndarray       # int [N]
    positions: tuple[int, ...] = ()  # per micro-batch; () : every one the whole budget

    @property
    def micro_batches(self) -> int:
        return self.rows // self.width

    def positions_of(self, k: int) -> int:
        """The positions of micro-batch k's rows."""
        return self.positions[k] if self.positions else self.budget

    @property
    def computed_tokens(self) -> int:
        return self.width * sum(self.positions_of(k) for k in range(self.micro_batches))

    @property
    def real_tokens(self) -> int:
        return int(self.length.sum())

    @functools.cached_property
    def _runs(self) -> list[tuple[int, int, int, int]]:
        """(source row, packed row, offset, length) of every placed rollout: a rollout's tokens are
        one run in both layouts, so packing is a slice copy per rollout (a few thousand a step):
        8-11x faster than scattering token by token through index arrays at 8.6M tokens
        (BENCHMARKS.md, "Packed rows: learner update on this CPU")."""
        placed = np.flatnonzero(self.length > 0)
        return list(zip(placed.tolist(), self.packed_row[placed].tolist(), self.offset[placed].tolist(),
                        self.length[placed].tolist()))

    def pack(self, x: np.ndarray) -> np.ndarray:
        """x [N, T] per token, or [N] per row (broadcast to its tokens) -> [rows, budget], 0 on
        padding."""
        out = np.zeros((self.rows, self.budget), x.dtype)
        for i, r, o, n in self._runs:
            out[r, o:o + n] = x[i, :n] if x.ndim == 2 else x[i]
        return out

    def unpack(self, y: np.ndarray, width: int) -> np.ndarray:
        """Packed per-token values [rows, budget] -> [N, width], 0 beyond each row's length."""
        out = np.zeros((len(self.length), width), y.dtype)
        for i, r, o, n in self._runs:
            out[i, :n] = y[r, o:o + n]
        return out

    def layout(self) -> dict[str, np.ndarray]:
        """The packed rows' `positions` (0 at each rollout's first token) and `segment_ids`
        (1, 2, ... within a packed row, 0 on padding), int32 [rows, budget]; and for cuDNN's
        packed attention `segment_starts` [rows, M + 1] and `segment_lengths` [rows, M] (-1 past
        a row's last segment; M the most segments of a row, rounded up to a power of two: few
        compiled shapes). An empty row gets one 1-token segment (its output is discarded)."""
        # a rollout's segment id: its rank among the rollouts of its packed row, by offset
        segment = np.zeros(len(self.length), np.int32)
        placed = np.flatnonzero(self.length > 0)
        order = placed[np.lexsort((self.offset[placed], self.packed_row[placed]))]
        first_of_row = np.r_[0, np.flatnonzero(np.diff(self.packed_row[order])) + 1]
        rank = np.arange(len(order)) - np.repeat(first_of_row, np.diff(np.r_[first_of_row, len(order)]))
        segment[order] = rank + 1
        positions = np.zeros((self.rows, self.budget), np.int32)
        segment_ids = np.zeros((self.rows, self.budget), np.int32)
        count = np.arange(self.budget, dtype=np.int32)
        for i, r, o, n in self._runs:
            positions[r, o:o + n] = count[:n]
            segment_ids[r, o:o + n] = segment[i]
        per_row = np.bincount(self.packed_row[placed], minlength=self.rows)
        bound = segment_bound(int(per_row.max(initial=1)))
        starts = np.full((self.rows, bound + 1), -1, np.int32)
        lengths = np.full((self.rows, bound), -1, np.int32)
        starts[:, 0], lengths[:, 0] = 0, 1  # empty rows; overwritten where a row has segments
        starts[self.packed_row[order], rank] = self.offset[order]
        lengths[self.packed_row[order], rank] = self.length[order]
        return {"positions": positions, "segment_ids": segment_ids, "segment_starts": starts,
                "segment_lengths": lengths}

    def micro_batch(self, packed: np.ndarray, k: int) -> np.ndarray:
        """The k-th micro-batch [width, positions_of(k)] of a packed [rows, budget] array (or its
        rows of a [rows, M] one: the cuDNN segment tables)."""
        rows = packed[k * self.width:(k + 1) * self.width]
        return rows[:, :self.positions_of(k)] if packed.shape[1] == self.budget else rows

    def joined(self, parts: list[np.ndarray]) -> np.ndarray:
        """Per-micro-batch outputs [width, positions_of(k)] -> one packed [rows, budget] array."""
        return np.concatenate([np.pad(p, ((0, 0), (0, self.budget - p.shape[1]))) for p in parts])


# The most rollouts (or SFT traces) a packed row holds by default: rl.segments_per_row and
# sft.segments_per_row (learner/settings.py says what it costs and saves).
SEGMENTS_PER_ROW = 32


def segment_bound(segments: int) -> int:
    """The segment tables' width for rows of at most `segments` rollouts: the power of two at or
    above it (few compiled shapes); what cuDNN's packed backward is sized by."""
    return 1 << (max(segments, 1) - 1).bit_length()


SHAPES_PER_OCTAVE = 32  # packed lengths: 32 per doubling, so rounding up adds < 1/32


def shape_length(n: int, budget: int) -> int:
    """`n` positions rounded up on a grid of SHAPES_PER_OCTAVE lengths per octave (at most
    `budget`): a row length the passes compile for. 1,000 -> 1,008; 9,700 -> 9,728."""
    step = max(1, (1 << max(int(n) - 1, 0).bit_length()) // (2 * SHAPES_PER_OCTAVE))
    return min(budget, max(-(-int(n) // step) * step, 1))


def plan_packing(lengths: np.ndarray, budget: int, width: int = 1, max_segments: int = 0) -> PackingPlan:
    """Rollouts of `lengths` balanced over the fewest rows of at most `budget` positions that hold
    them, at most `max_segments` rollouts a row (0: no bound), rows a multiple of `width` (at least
    one micro-batch). A rollout longer than the budget is an error (the config check keeps
    rollout.max_len within it).

    Three placements, the one computing fewest positions kept: balanced (longest first, each
    rollout to the least-filled row with room for it, the LPT rule: no row ends more than the
    longest rollout above the mean, when the segment bound does not bind; where some rollout finds
    no room, ~3% more rows and the placement redone), first fit (rows filled to the brim: better
    near a full budget), and micro-batch by micro-batch (`_filled`). The rows are then ordered
    fullest first, so each micro-batch holds rows of like fill and is cut to its fullest.

    Why bound the rollouts of a row: cuDNN's packed attention sizes its backward pass's float32
    accumulator by rows x (segment bound) x heads x budget x head_dim, whatever the rows hold
    (BENCHMARKS.md, "Packed rows on an H200: MFU on real tokens..."), so the segments of the
    fullest row, not the tokens, set that memory; bounded, the memory plan can count it."""
    lengths = np.asarray(lengths, np.int64)
    if budget < 1 or width < 1 or max_segments < 0:
        raise ValueError(f"packing needs a positive budget and width and max_segments >= 0, got {budget}, {width} "
                         f"and {max_segments}")
    if lengths.size and lengths.max() > budget:
        i = int(lengths.argmax())
        raise ValueError(f"row {i} has {lengths[i]} tokens, more than the packing budget of {budget} "
                         "(rl.token_budget must be at least rollout.max_len)")
    order = sorted(np.flatnonzero(lengths > 0).tolist(), key=lambda i: (-lengths[i], i))
    room = max_segments or len(lengths) + 1
    fewest = max(-(-int(lengths.sum()) // budget), -(-len(order) // room), 1)
    least = rows = -(-fewest // width) * width
    while (balanced := _balanced(lengths, order, budget, rows, room)) is None:
        rows += -(-max(rows // 32, 1) // width) * width  # 3% more rows a try: few tries near a full budget
    # near a full budget, balancing leaves every row a little short of the longest rollout's, which
    # sets its micro-batch's length; first fit fills rows to the brim instead; micro-batch by
    # micro-batch fills the one holding the longest rollout to its length, from the fewest rows
    # that hold the tokens on (balancing may need more than a few huge rollouts leave room for).
    # Each is a few ms for 2,048 rollouts: keep the cheapest.
    placements = [balanced, _first_fit(lengths, order, budget, width, room)]
    for count in range(least, rows + 2 * width + 1, width)[:8]:
        if (filled := _filled(lengths, order, budget, width, count, room)) is not None:
            placements.append(filled)
            break
    plans = [_cut(lengths, order, budget, width, *placed) for placed in placements]
    return min(plans, key=lambda plan: plan.computed_tokens)


def _cut(lengths, order, budget, width, row_of, offset, fill) -> PackingPlan:
    """A placement as a plan: rows ordered fullest first, `width` to a micro-batch, each cut to
    its fullest row."""
    rows = len(fill)
    rank = np.empty(rows, np.int64)
    rank[np.lexsort((np.arange(rows), -fill))] = np.arange(rows)
    packed_row = np.full(len(lengths), -1, np.int64)
    packed_row[order] = rank[row_of[order]]
    fill = np.sort(fill)[::-1]
    positions = tuple(shape_length(max(int(fill[k * width]), 1), budget) for k in range(rows // width))
    return PackingPlan(budget, width, rows, packed_row, offset, lengths.copy(), positions)


def _filled(lengths, order, budget, width, rows, room):
    """Micro-batch by micro-batch: each one's rows filled up to its length, the longest rollout
    left or the tokens left spread over the rows left, whichever is more (on the length grid),
    each row taking the longest rollout left that fits until none does; the rest goes on to the
    next. Fills the micro-batch that holds the longest rollout to that length instead of leaving
    its other rows at the mean. (row of each rollout, its offset, each row's fill), or None when
    rollouts are left over."""
    fill = np.zeros(rows, np.int64)
    row_of = np.full(len(lengths), -1, np.int64)
    offset = np.zeros(len(lengths), np.int64)
    left = sorted((int(lengths[i]), i) for i in order)  # ascending: bisect finds the longest that fits
    total = sum(n for n, _ in left)
    for first in range(0, rows, width):
        if not left:
            break
        if first + width == rows:  # the last (its rows still empty) takes what is left, balanced
            tail = [i for _, i in reversed(left)]
            if (placed := _balanced(lengths, tail, budget, width, room)) is None:
                return None
            tail_row, tail_offset, tail_fill = placed
            row_of[tail], offset[tail] = first + tail_row[tail], tail_offset[tail]
            fill[first:] = tail_fill
            return row_of, offset, fill
        cap = shape_length(max(left[-1][0], -(-total // (rows - first))), budget)
        for row in range(first, first + width):
            held = 0
            while left and held < room:
                at = bisect.bisect_right(left, (cap - int(fill[row]), len(lengths))) - 1
                if at < 0:
                    break
                n, i = left.pop(at)
                row_of[i], offset[i] = row, fill[row]
                fill[row] += n
                held += 1
                total -= n
    return None if left else (row_of, offset, fill)


def _first_fit(lengths, order, budget, width, room):
    """Each rollout of `order` (longest first) in the first row with room for it, rows opened as
    needed and rounded up to a multiple of `width`: (row of each rollout, its offset, each row's fill)."""
    fill = np.zeros(len(order) + width, np.int64)
    held = np.zeros(len(order) + width, np.int64)
    row_of = np.full(len(lengths), -1, np.int64)
    offset = np.zeros(len(lengths), np.int64)
    opened = 0
    for i in order:
        n = int(lengths[i])
        fits = (budget - fill[:opened] >= n) & (held[:opened] < room)
        row = int(np.argmax(fits)) if fits.any() else opened
        opened = max(opened, row + 1)
        row_of[i], offset[i] = row, fill[row]
        fill[row] += n
        held[row] += 1
    rows = max(-(-opened // width), 1) * width
    return row_of, offset, fill[:rows]


def _balanced(lengths, order, budget, rows, room):
    """Each rollout of `order` (longest first) in the least-filled of `rows` rows that still takes
    a segment (the least-filled has the most room: if the rollout does not fit there, it fits
    nowhere): (row of each rollout, its offset, each row's fill), or None when one does not fit."""
    fill = np.zeros(rows, np.int64)
    held = np.zeros(rows, np.int64)
    row_of = np.full(len(lengths), -1, np.int64)
    offset = np.zeros(len(lengths), np.int64)
    open_rows = [(0, r) for r in range(rows)]  # a heap of (fill, row) over the rows with segment room
    for i in order:
        n = int(lengths[i])
        if not open_rows or open_rows[0][0] + n > budget:
            return None
        _, row = heapq.heappop(open_rows)
        row_of[i], offset[i] = row, fill[row]
        fill[row] += n
        held[row] += 1
        if held[row] < room:
            heapq.heappush(open_rows, (int(fill[row]), row))
    return row_of, offset, fill


def row_lengths(loss_mask: np.ndarray) -> np.ndarray:
    """Each row's extent when a batch does not record it: up to its last model token (what
    follows it changes no log-prob the loss reads)."""
    any_ = loss_mask.any(axis=-1)
    last = loss_mask.shape[-1] - np.argmax(loss_mask[:, ::-1] > 0, axis=-1)
    return np.where(any_, last, 0)
