"""Trajectories -> padded training arrays, with length bucketing.

Sequences are right-padded to a multiple of `pad_multiple` and the batch can be padded with
all-masked rows to a multiple of `rows_multiple` (few compiled shapes, some waste); the Learner
pads what it is given to micro-batches x the mesh's batch width itself (`pad_rows`). Masks and
log-probs stay aligned with token positions: position t holds the token, its loss mask, and
log p(token_t | tokens_<t).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class TrainBatch:
    tokens: np.ndarray            # int32 [N, T]
    loss_mask: np.ndarray         # float32 [N, T]
    advantages: np.ndarray        # float32 [N]
    sampler_logprobs: np.ndarray  # float32 [N, T]
    old_logprobs: np.ndarray | None = None  # float32 [N, T], recomputed by the learner
    entropy: np.ndarray | None = None       # float32 [N, T], per-token entropy from the same pass
    lengths: np.ndarray | None = None       # int [N], each row's tokens (packing reads it; 0: padding row)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_batch(token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
               sampler_logprobs: Sequence[Sequence[float]], advantages: Sequence[float], *,
               pad_multiple: int = 64, rows_multiple: int = 1, pad_id: int = 0, max_len: int | None = None,
               max_rows: int | None = None) -> TrainBatch:
    """Right-padded arrays of the rows: the width a multiple of `pad_multiple` (at most `max_len`:
    longer rows are cut), the rows a multiple of `rows_multiple` (at most `max_rows`, never fewer
    than given) with all-masked rows added."""
    if not (len(token_ids) == len(loss_masks) == len(sampler_logprobs) == len(advantages)):
        raise ValueError("token_ids, loss_masks, sampler_logprobs and advantages differ in length")
    longest = max((len(t) for t in token_ids), default=1)
    t = round_up(longest, pad_multiple)
    if max_len is not None:
        t = min(t, max_len)
    n = round_up(max(len(token_ids), 1), rows_multiple)
    if max_rows is not None:
        n = max(min(n, max_rows), len(token_ids))
    tokens = np.full((n, t), pad_id, np.int32)
    mask = np.zeros((n, t), np.float32)
    logp = np.zeros((n, t), np.float32)
    adv = np.zeros(n, np.float32)
    lengths = np.zeros(n, np.int64)
    for i, (ids, m, lp) in enumerate(zip(token_ids, loss_masks, sampler_logprobs)):
        if not len(ids) == len(m) == len(lp):
            raise ValueError(f"row {i}: tokens, mask and log-probs differ in length")
        k = min(len(ids), t)
        tokens[i, :k] = ids[:k]
        mask[i, :k] = m[:k]
        logp[i, :k] = lp[:k]
        adv[i] = advantages[i]
        lengths[i] = k
    mask[:, 0] = 0.0  # the first token has no log-prob (nothing predicts it)
    return TrainBatch(tokens, mask, adv, logp, lengths=lengths)


def pad_rows(batch: TrainBatch, multiple: int) -> TrainBatch:
    """`batch` with all-masked rows appended up to a multiple of `multiple` rows (itself when it
    already divides). Masked rows add nothing to the loss sum or the token count."""
    n = batch.tokens.shape[0]
    extra = round_up(max(n, 1), multiple) - n
    if extra == 0:
        return batch

    def pad(x):
        return None if x is None else np.concatenate([x, np.zeros((extra,) + x.shape[1:], x.dtype)])
    return TrainBatch(pad(batch.tokens), pad(batch.loss_mask), pad(batch.advantages), pad(batch.sampler_logprobs),
                      pad(batch.old_logprobs), pad(batch.entropy), pad(batch.lengths))
