"""Packing: the rows of an update placed into token-budgeted packed rows, and back.

Padded rows (batching.py) are as wide as the longest rollout; agentic rollouts have a long
tail, so most of a padded rectangle is padding (45% real tokens on the demo's traces). Packed,
each rollout keeps its own tokens, positions restarting at 0 and a segment id (1, 2, ... in its
packed row; 0 is padding), and the decoder attends within a segment only. A packed row holds
`budget` positions (verl's `ppo_max_token_len_per_gpu` with `use_dynamic_bsz`); rows are filled
first-fit, longest rollout first, and grouped `width` at a time (the devices a micro-batch splits
over) into micro-batches, so the number of micro-batches follows from the tokens, not a setting.

Only the model's passes run packed. Everything else keeps the padded layout [N, T] it has
always had: `PackingPlan.pack` moves a per-token [N, T] (or per-row [N]) array into the packed
layout, `unpack` brings packed per-token values back (as verl's remove-padding pads log-probs
back to [batch, seq]). The plan is a pure function of the rows' lengths: every process of a
multi-process learner builds the same plan from the same batch.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackingPlan:
    """Where each of N padded rows lies in `rows` packed rows of `budget` positions.

    packed_row[i], offset[i]: rollout i's first token; length[i]: its tokens (0: a padding row,
    not placed, packed_row -1). rows is a multiple of `width`. The last micro-batch holds the
    last rows opened (first fit decreasing: the small rollouts'): it is cut to `last_positions` (its
    fullest row, rounded up to an eighth of the budget: few compiled shapes), so a small update is
    not mostly one padded row."""
    budget: int
    width: int
    rows: int
    packed_row: np.ndarray   # int [N]
    offset: np.ndarray       # int [N]
    length: np.ndarray       # int [N]
    last_positions: int = 0  # 0: the budget

    @property
    def micro_batches(self) -> int:
        return self.rows // self.width

    def positions_of(self, k: int) -> int:
        """The positions of micro-batch k's rows."""
        return self.last_positions or self.budget if k == self.micro_batches - 1 else self.budget

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


def plan_packing(lengths: np.ndarray, budget: int, width: int = 1, max_segments: int = 0) -> PackingPlan:
    """First-fit decreasing of rollouts of `lengths` into rows of `budget` positions, at most
    `max_segments` rollouts a row (0: no bound), rows padded to a multiple of `width` (at least
    one micro-batch). A rollout longer than the budget is an error (the config check keeps
    rollout.max_len within it).

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
    packed_row = np.full(len(lengths), -1, np.int64)
    offset = np.zeros(len(lengths), np.int64)
    free = np.full(len(lengths) + width, budget, np.int64)  # room left in each row (opened or not)
    held = np.zeros(len(lengths) + width, np.int64)         # rollouts in each row
    room = max_segments or len(lengths) + 1
    opened = 0
    for i in sorted(np.flatnonzero(lengths > 0), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        fits = (free[:opened] >= n) & (held[:opened] < room)
        row = int(np.argmax(fits)) if fits.any() else opened
        opened = max(opened, row + 1)
        packed_row[i], offset[i] = row, budget - free[row]
        free[row] -= n
        held[row] += 1
    rows = max(-(-opened // width), 1) * width
    fill = budget - free[rows - width:rows]  # the last micro-batch's rows (0 past those opened)
    granule = max(budget // 8, 1)
    last = min(max(-(-int(fill.max()) // granule), 1) * granule, budget)
    return PackingPlan(budget, width, rows, packed_row, offset, lengths.copy(), last)


def row_lengths(loss_mask: np.ndarray) -> np.ndarray:
    """Each row's extent when a batch does not record it: up to its last model token (what
    follows it changes no log-prob the loss reads)."""
    any_ = loss_mask.any(axis=-1)
    last = loss_mask.shape[-1] - np.argmax(loss_mask[:, ::-1] > 0, axis=-1)
    return np.where(any_, last, 0)
