"""The correction seam: off-policy corrections between the sampler and the learner.

The engine samples a token with its own numerics (another kernel, bf16) and, under
asynchronous rollouts, weights some versions old; the learner's proximal ("old") log-probs are
recomputed with its current weights. A correction reads the two per token and returns

    Correction(weight [B, T] >= 0,  keep [B, T] bool,  clipped [B, T] bool)

The update multiplies each token's loss by `weight` and drops the tokens that `keep` excludes
from the loss *and* from the aggregation's count (verl's rejection sampling modifies the
response mask the same way). Corrections compose: `compose` multiplies the weights and ANDs
the masks, so `rl.correction.names=(token_tis, geo_mask)` is one setting. Weights are constants
of the update (functions of recomputed and sampled log-probs only): no gradient flows in them.

A correction is one function, registered with its settings Section:

    @register_correction("my_mask", settings=MyMaskSettings)
    def my_mask(x: CorrectionInputs, s: MyMaskSettings) -> Correction:
        return Correction.mask(x.mask & (x.token_log_ratio() > math.log(s.low)))

It sees the whole of each sequence (rows are never split, and on packed rows a sequence is a
segment: `CorrectionInputs.sequence_sum`), so a sequence-level correction is exact under
micro-batching and on packed rows. Metrics (`correction_metrics`) are computed once per update, on
the host, from the same functions: what each correction masked or clipped, the effective sample
size of the combined weights, and the sampler-vs-learner mismatch (k1 and k3, per token and per
sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rstar2_jax.core.config_types import Section
from rstar2_jax.core.registry import Registry
from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND
from rstar2_jax.algo.segments import segment_sum


@flax.struct.dataclass
class CorrectionInputs:
    """[B, T], aligned with token positions; `mask` is True on the model's own tokens. Packed
    rows (several sequences a row) pass their `segment_ids`: a sequence is then a segment."""
    learner_logprobs: jax.Array   # proximal: the learner's log-probs before the update
    sampler_logprobs: jax.Array   # behaviour: the engine's, as it sampled
    mask: jax.Array               # bool
    segment_ids: jax.Array | None = None

    def token_log_ratio(self) -> jax.Array:
        """log(pi_learner / pi_sampler) per token, 0 outside the mask (never NaN from padding)."""
        return jnp.where(self.mask, self.learner_logprobs - self.sampler_logprobs, 0.0)

    def sequence_sum(self, x: jax.Array) -> jax.Array:
        """Each sequence's sum of x [B, T]: [B, 1] for one sequence per row, [B, T] (on each
        segment's positions) for packed rows; `per_token` spreads either over the tokens."""
        if self.segment_ids is None:
            return jnp.sum(x, axis=-1, keepdims=True)
        return segment_sum(x, self.segment_ids)

    def seq_log_ratio(self) -> jax.Array:
        """log of the sequence's importance ratio prod_t r_t (see `sequence_sum`)."""
        return self.sequence_sum(self.token_log_ratio())

    def geo_log_ratio(self) -> jax.Array:
        """log of the geometric mean of the sequence's token ratios (0 for empty sequences)."""
        return self.seq_log_ratio() / jnp.maximum(self.sequence_sum(self.mask.astype(jnp.float32)), 1.0)

    def per_token(self, per_seq: jax.Array) -> jax.Array:
        """A per-sequence value ([B, 1], or [B, T] on packed rows) on every token of its sequence [B, T]."""
        return jnp.broadcast_to(per_seq, self.mask.shape)


@flax.struct.dataclass
class Correction:
    weight: jax.Array    # [B, T] multiplies each token's loss
    keep: jax.Array      # [B, T] bool: False drops the token from the loss and its count
    clipped: jax.Array   # [B, T] bool: tokens whose weight a cap truncated (a statistic)

    @classmethod
    def weights(cls, weight, clipped=None) -> Correction:
        ones = jnp.ones(weight.shape, bool)
        return cls(weight, ones, jnp.zeros(weight.shape, bool) if clipped is None else clipped)

    @classmethod
    def mask(cls, keep) -> Correction:
        return cls(jnp.ones(keep.shape, jnp.float32), keep, jnp.zeros(keep.shape, bool))

    @classmethod
    def identity(cls, shape) -> Correction:
        return cls.mask(jnp.ones(shape, bool))


@dataclasses.dataclass(frozen=True)
class CorrectionSpec:
    fn: Callable[[CorrectionInputs, Section], Correction]
    settings: type[Section]
    level: str    # "token" or "sequence": what the correction's decision is made on (documentation, metrics)


CORRECTIONS: Registry[CorrectionSpec] = Registry("off-policy correction")


def register_correction(name: str, *, settings: type[Section], level: str):
    """Decorator: registers a correction function with its settings section."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")

    def deco(fn):
        CORRECTIONS.register(name, CorrectionSpec(fn, settings, level))
        return fn
    return deco


def apply_correction(name: str, inputs: CorrectionInputs, settings: Section) -> Correction:
    """The registered correction `name`, restricted to the mask (weight 0 and keep False outside)."""
    c = CORRECTIONS[name].fn(inputs, settings)
    keep = c.keep & inputs.mask
    return Correction(jnp.where(keep, c.weight, 0.0).astype(jnp.float32), keep, c.clipped & keep)


def compose(corrections: Sequence[Correction], shape) -> Correction:
    """Several corrections as one: weights multiply, masks AND, clipped ORs (order-free)."""
    out = Correction.identity(shape)
    for c in corrections:
        out = Correction(out.weight * c.weight, out.keep & c.keep, out.clipped | c.clipped)
    return out


def combined_correction(names: Sequence[str], settings_of: Callable[[str], Section],
                        inputs: CorrectionInputs) -> Correction:
    """The corrections `names` applied together on `inputs` (identity on the mask when none)."""
    return _restricted(compose([apply_correction(n, inputs, settings_of(n)) for n in names], inputs.mask.shape),
                       inputs.mask)


def _restricted(c: Correction, mask) -> Correction:
    """`c` on the model's tokens only: weight 0, not kept and not clipped elsewhere."""
    return Correction(jnp.where(c.keep, c.weight, 0.0), c.keep & mask, c.clipped & mask)


# ---- metrics (host side, once per update) --------------------------------------------------------
def mismatch_metrics(inputs: CorrectionInputs) -> dict[str, float]:
    """Sampler-vs-learner mismatch on the model's tokens: KL(sampler || learner) estimated from the
    sampler's own tokens, with r = pi_learner / pi_sampler (J. Schulman, "Approximating KL
    divergence", 2020; AReaL and verl report the same pair):

        k1 = -log r            per token, and summed over each sequence (its sequence KL)
        k3 = r - 1 - log r     >= 0, likewise

    Per-token figures are token means; per-sequence figures are means over sequences of the
    sequence's sum (the KL of the whole response, by the chain rule)."""
    m = np.asarray(inputs.mask, bool)
    if not m.any():
        return {}
    log_r = np.clip(np.asarray(inputs.token_log_ratio(), np.float64), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    k1 = np.where(m, -log_r, 0.0)
    k3 = np.where(m, np.exp(log_r) - 1.0 - log_r, 0.0)
    rows = m.any(axis=-1)
    return {"mismatch/k1_token": float(k1.sum() / m.sum()), "mismatch/k3_token": float(k3.sum() / m.sum()),
            "mismatch/k1_seq": float(k1.sum(-1)[rows].mean()), "mismatch/k3_seq": float(k3.sum(-1)[rows].mean())}


def effective_sample_size(weight: np.ndarray, mask: np.ndarray) -> float:
    """Normalised effective sample size of per-token weights over the masked tokens,
    (sum w)^2 / (n sum w^2) in [0, 1] (Kish; 1: every token weighs the same, as on-policy). A
    token a correction dropped counts with weight 0."""
    w = np.asarray(weight, np.float64)[np.asarray(mask, bool)]
    if w.size == 0 or not (w > 0).any():
        return 0.0
    return float(w.sum() ** 2 / (w.size * np.square(w).sum()))


def correction_metrics(names: Sequence[str], settings_of: Callable[[str], Section],
                       inputs: CorrectionInputs) -> dict[str, float]:
    """What the corrections did to one update's tokens (token means over the model's tokens):
    per correction its masked and clipped fractions (and, for a sequence-level one, the
    fraction of sequences it dropped); for them together the weight mean, the masked fraction and
    the effective sample size; and the sampler-vs-learner mismatch (mismatch_metrics)."""
    m = np.asarray(inputs.mask, bool)
    out = mismatch_metrics(inputs)
    if not m.any() or not names:
        return out
    rows = m.any(axis=-1)
    parts = {name: apply_correction(name, inputs, settings_of(name)) for name in names}  # each computed once
    for name, c in parts.items():
        keep, clipped = np.asarray(c.keep), np.asarray(c.clipped)
        out[f"correction/{name}/masked_fraction"] = float((m & ~keep).sum() / m.sum())
        out[f"correction/{name}/clipped_fraction"] = float(clipped.sum() / m.sum())
        if CORRECTIONS[name].level == "sequence":
            out[f"correction/{name}/seq_masked_fraction"] = float((~keep.any(-1))[rows].mean())
    both = _restricted(compose(list(parts.values()), inputs.mask.shape), inputs.mask)
    weight, keep = np.asarray(both.weight), np.asarray(both.keep)
    out["correction/masked_fraction"] = float((m & ~keep).sum() / m.sum())
    out["correction/weight_mean"] = float(weight[m].mean())
    out["correction/ess"] = effective_sample_size(weight, m)
    return out
