"""The jitted policy update: a pure function of (state, mini-batch).

The loss is the registered policy loss (algo/losses) on one `LossInputs`, weighted and masked
by the off-policy corrections in use (algo/corrections: computed once per mini-batch, before any
gradient, from the learner's and the sampler's log-probs), plus a KL term to a frozen reference,
then aggregated (algo/aggregation.py). Gradient accumulation over micro-batches is a `lax.scan` of gradients of
each micro-batch's *scaled sum*, divided once by the aggregation's count of the whole
mini-batch (computed from the mask before any gradient), so M micro-batches give the same
update as one, in every aggregation mode. Statistics are token means over the mini-batch.

One pass (rl.old_logprobs, where one optimizer step makes it exact): the batch has no
old_logprobs; the forward pass differentiated gives them too, stop-gradient, so the corrections
and the count are computed inside it, each micro-batch's gradient is of its unnormalised scaled
sum, and the sum is divided once by the counts the micro-batches added up (the aggregation's count
is a sum over sequences). The step returns those log-probs (and entropies) for the metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from rstar2_jax.algo import (AGGREGATIONS, KL_ESTIMATORS, LOSSES, KLConfig, LossInputs, PolicyLossConfig,
                             policy_loss_terms)
from rstar2_jax.algo.corrections import CorrectionConfig, CorrectionInputs, combined_correction
from rstar2_jax.models.attention import PackedSegments
from rstar2_jax.models.lora import dropout_key, merged
from rstar2_jax.models.logprobs import LOGPROB_CHUNK, token_logprobs


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any          # nnx.State of the trained Params (float32 master weights): all of them, or the
                         # LoRA adapters (models/lora.py; the frozen base then lives beside the state)
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """What the jitted update reads: the run's `rl.loss`, `rl.kl`, `rl.correction` sections and
    `rl.micro_batches` as they are (`of`: no second defaults), the sampler's temperature, and C."""
    loss: PolicyLossConfig
    kl: KLConfig
    # Off-policy corrections between the sampler's log-probs and the learner's recomputed ones
    # (none: the paper's setting; the batch then needs no sampler_logprobs).
    correction: CorrectionConfig
    micro_batches: int
    temperature: float     # the sampler's: log-probs are those of the tempered distribution
    constant_tokens: float  # aggregation=constant: C (0: no constant aggregation to serve)
    token_entropy: bool = False  # a one-pass update also returns each token's entropy (rl.token_entropy)
    logprob_chunk: int = LOGPROB_CHUNK

    @classmethod
    def of(cls, settings, *, temperature: float, constant_tokens: float | None = None) -> UpdateConfig:
        """From the learner's settings (rl.*, learner/settings.LearnerSettings). constant_tokens:
        C of aggregation=constant; None takes rl.loss.constant_tokens, and with that 0 (the run's
        largest response budget, which only the run knows: RunConfig.constant_tokens) a constant
        aggregation is refused rather than run with an arbitrary C."""
        c = settings.loss.constant_tokens if constant_tokens is None else constant_tokens
        if not c and AGGREGATIONS[settings.loss.aggregation_name()].needs_constant:
            raise ValueError("aggregation=constant needs C: set rl.loss.constant_tokens, or pass the run's "
                             "largest response budget (RunConfig.constant_tokens) as constant_tokens")
        return cls(loss=settings.loss, kl=settings.kl, correction=settings.correction,
                   micro_batches=settings.micro_batches, temperature=temperature, constant_tokens=float(c),
                   token_entropy=settings.token_entropy)

    @property
    def needs_sampler_logprobs(self) -> bool:
        return self.correction.enabled or LOSSES[self.loss.name].needs_sampler_logprobs


def compute_logprobs(graphdef, params, tokens, cfg: UpdateConfig, with_entropy: bool = False, positions=None,
                     segment_ids=None, remat: bool = True, frozen=None):
    """Log-probs of every token under `params` [N, T] (the learner's 'old' log-probs); with
    `with_entropy`, also the entropy of the distribution each token was drawn from [N, T].
    Packed rows pass their `positions` and `segment_ids`: a sequence's first token then gets 0,
    as position 0 of a padded row (nothing of its own predicts it). remat=False: a pass with no
    gradient, which has no backward to save memory for (and nnx.remat inside lax.map fails:
    "Cannot mutate Param from a different trace level", flax 0.12). frozen: the base's Params when
    `params` are LoRA adapters (never differentiated: jax.grad sees only `params`)."""
    model = merged(graphdef, params, frozen)
    if not remat:
        model.remat = "none"
    out = token_logprobs(model, tokens, positions, segment_ids, chunk_size=cfg.logprob_chunk,
                         temperature=cfg.temperature, with_entropy=with_entropy)
    if positions is not None:
        out = jax.tree.map(lambda x: jnp.where(positions > 0, x, 0.0), out)
    return out


def packed_segments(mb: dict):
    """A packed micro-batch's segments as the decoder takes them (None: padded rows)."""
    if "segment_ids" not in mb:
        return None
    return PackedSegments(mb["segment_ids"], mb["segment_starts"], mb["segment_lengths"])


def packed_logprobs(graphdef, params, mb: dict, cfg: UpdateConfig, with_entropy: bool = False, frozen=None):
    """`compute_logprobs` of one packed micro-batch (tokens and the plan's layout)."""
    return compute_logprobs(graphdef, params, mb["tokens"], cfg, with_entropy, mb["positions"], packed_segments(mb),
                            remat=False, frozen=frozen)


def batch_logprobs(graphdef, params, tokens, cfg: UpdateConfig, with_entropy: bool = False, frozen=None):
    """`compute_logprobs` of a whole batch, cfg.micro_batches rows-slices at a time (a `lax.map`),
    so the old-log-prob pass holds one micro-batch's activations, as the update does, never the
    whole batch's (a batch whose rows do not split evenly goes in one piece)."""
    n, m = tokens.shape[0], cfg.micro_batches
    if m == 1 or n % m:
        return compute_logprobs(graphdef, params, tokens, cfg, with_entropy, remat=False, frozen=frozen)
    micro = tokens.reshape((m, n // m) + tokens.shape[1:])
    out = jax.lax.map(lambda t: compute_logprobs(graphdef, params, t, cfg, with_entropy, remat=False, frozen=frozen),
                      micro)
    return jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), out)


def _loss_terms(graphdef, cfg: UpdateConfig, params, batch, frozen=None):
    """(scaled loss sum, {statistic: token sum}, per-token outputs) of one (micro-)batch: the
    policy loss, the corrections' weights (`is_weight`, when corrections are on) and the KL term,
    masked and scaled per sequence by the aggregation.

    A batch without `old_logprobs` is a one-pass update (rl.old_logprobs): the old log-probs are
    this pass's own, stop-gradient (the weights they are of are the ones differentiated), so the
    corrections and the aggregation's scale are computed here from them, the statistics carry this
    micro-batch's share of the normaliser and of the kept tokens (`_count`, `_kept`: the caller
    divides once the whole mini-batch is summed), and the per-token outputs are the log-probs (and
    with cfg.token_entropy the entropies) [N, T] the separate pass would have returned."""
    one_pass = "old_logprobs" not in batch
    with_entropy = one_pass and cfg.token_entropy
    out = compute_logprobs(graphdef, params, batch["tokens"], cfg, with_entropy=with_entropy,
                           positions=batch.get("positions"), segment_ids=packed_segments(batch), frozen=frozen)
    lp = out[0] if with_entropy else out
    outputs = {}
    if one_pass:
        outputs["logprobs"] = old = jax.lax.stop_gradient(lp)
        if with_entropy:
            outputs["entropy"] = jax.lax.stop_gradient(out[1])
        batch = corrected(cfg, {**batch, "old_logprobs": old})
    mask = batch["loss_mask"] > 0
    inputs = LossInputs(lp, batch["old_logprobs"], batch["advantages"], mask, batch.get("sampler_logprobs"),
                        batch.get("ref_logprobs"), segment_ids=batch.get("segment_ids"),
                        log_ratio_clamp=cfg.loss.log_ratio_clamp).sanitized()
    terms = policy_loss_terms(cfg.loss.name, inputs, cfg.loss.settings())
    per_token, stats = terms.per_token, dict(terms.stats)
    if "is_weight" in batch:
        per_token = per_token * jax.lax.stop_gradient(batch["is_weight"])
    if cfg.kl.in_loss:
        kl = jnp.where(mask, KL_ESTIMATORS[cfg.kl.estimator](inputs.logprobs, inputs.ref_logprobs), 0.0)
        per_token = per_token + cfg.kl.coef * kl
        stats[f"kl_ref_{cfg.kl.estimator}"] = kl
    stats["nll_per_token"] = -inputs.logprobs
    aggregation = AGGREGATIONS[cfg.loss.aggregation_name()]
    if "token_scale" in batch:  # packed rows: each token carries its row's scale, computed before packing
        token_scale = batch["token_scale"]
    elif "segment_ids" in batch:  # packed rows, one pass: the scale of each token's sequence, from its mask here
        token_scale = aggregation.token_scale(mask, batch["segment_ids"])
    else:
        token_scale = aggregation.row_scale(mask)[:, None]
    loss_sum = jnp.sum(jnp.where(mask, per_token, 0.0) * token_scale)
    sums = {k: jnp.sum(v) for k, v in stats.items()}
    if one_pass:
        sums["_count"] = (aggregation.segment_count(mask, batch["segment_ids"], cfg.constant_tokens)
                          if "segment_ids" in batch else aggregation.count(mask, cfg.constant_tokens))
        sums["_kept"] = jnp.sum(mask).astype(jnp.float32)
    return loss_sum, sums, outputs


def corrected(cfg: UpdateConfig, batch: dict) -> dict:
    """`batch` with the off-policy corrections applied (unchanged when none): `is_weight` [N, T],
    and the tokens they drop taken out of `loss_mask`, so they leave the loss and its count (on
    packed rows a sequence-level correction reads each segment)."""
    if not cfg.correction.enabled:
        return batch
    c = combined_correction(cfg.correction.names, cfg.correction.settings_of,
                            CorrectionInputs(batch["old_logprobs"], batch["sampler_logprobs"], batch["loss_mask"] > 0,
                                             batch.get("segment_ids")))
    return {**batch, "loss_mask": c.keep.astype(batch["loss_mask"].dtype), "is_weight": c.weight}


def loss_count(cfg: UpdateConfig, mask) -> jax.Array:
    """The aggregation's normaliser of a whole (mini-)batch: depends on the mask alone."""
    return jnp.maximum(AGGREGATIONS[cfg.loss.aggregation_name()].count(mask > 0, cfg.constant_tokens), 1e-9)


def _one_pass_normalised(grads, stats: dict):
    """A one-pass update's summed (gradient, statistics) divided by the normaliser its
    micro-batches counted: (gradient, statistics, count, tokens kept)."""
    stats = dict(stats)
    count = jnp.maximum(stats.pop("_count"), 1e-9)
    kept = jnp.maximum(stats.pop("_kept"), 1.0)
    return jax.tree.map(lambda g: g / count, grads), stats, count, kept


def step_key(step, micro) -> jax.Array:
    """The PRNG key of optimizer step `step`'s micro-batch `micro`: LoRA dropout's (models/lora.py),
    so a resumed run drops what the uninterrupted one did."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), step), micro)


def _micro_gradients(graphdef, cfg: UpdateConfig, params, mb: dict, count, frozen=None, key=None):
    """((gradient, {statistic: sum}), per-token outputs) of one micro-batch's scaled loss sum /
    `count` (the whole mini-batch's normaliser; 1 in a one-pass update, which divides at the end):
    summed over micro-batches, the mini-batch's gradient. key: LoRA dropout's (None: none)."""
    def micro_loss(p):
        with dropout_key(key):
            loss_sum, stats, outputs = _loss_terms(graphdef, cfg, p, mb, frozen)
        return loss_sum / count, ({**stats, "policy_loss": loss_sum}, outputs)
    grads, (stats, outputs) = jax.grad(micro_loss, has_aux=True)(params)
    return (grads, stats), outputs


def _zeros_like_gradients(graphdef, cfg: UpdateConfig, params, mb: dict, frozen=None):
    """Zeros shaped as `_micro_gradients`' sums: the gradient's like the parameters (their
    shardings too: the accumulator is split as they are), the statistics' from the loss and the
    options in use (nothing hard-coded here)."""
    stats = jax.eval_shape(lambda p, b: _micro_gradients(graphdef, cfg, p, b, 1.0, frozen), params, mb)[0][1]
    return jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats)


def _applied(tx: optax.GradientTransformation, state: TrainState, grads, stats: dict, count, total_tokens):
    """The optimizer step on the accumulated `grads`, and the step's metrics."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {k: v / total_tokens for k, v in stats.items() if k != "policy_loss"}
    metrics.update(policy_loss=stats["policy_loss"] / count, grad_norm=optax.global_norm(grads),
                   update_norm=optax.global_norm(updates), tokens=total_tokens)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def train_step(graphdef, tx: optax.GradientTransformation, cfg: UpdateConfig, state: TrainState, batch: dict,
               frozen=None):
    """One optimizer step on padded rows: (state, metrics, per-token outputs). batch: tokens
    [N, T], loss_mask [N, T], advantages [N], old_logprobs [N, T] (sampler_logprobs [N, T] with
    corrections, ref_logprobs [N, T] with a KL term); cfg.micro_batches row slices, accumulated in
    a `lax.scan`. Without old_logprobs the step is one pass (`_loss_terms`) and the outputs are
    its log-probs (and entropies) [N, T]; else they are empty. frozen: the LoRA base (None: the
    state's params are the whole model)."""
    one_pass = "old_logprobs" not in batch
    n = batch["tokens"].shape[0]
    m = cfg.micro_batches
    if n % m:
        raise ValueError(f"batch of {n} rows does not split into {m} micro-batches")
    if not one_pass:
        batch = corrected(cfg, batch)
        count = loss_count(cfg, batch["loss_mask"])
    micro = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), batch)

    def accumulate(carry, xs):
        mb, i = xs
        out, outputs = _micro_gradients(graphdef, cfg, state.params, mb, 1.0 if one_pass else count, frozen,
                                        step_key(state.step, i))
        return jax.tree.map(jnp.add, carry, out), outputs

    zeros = _zeros_like_gradients(graphdef, cfg, state.params, jax.tree.map(lambda x: x[0], micro), frozen)
    (grads, stats), outputs = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(m)))
    outputs = jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), outputs)
    if one_pass:
        grads, stats, count, total = _one_pass_normalised(grads, stats)
    else:
        total = jnp.maximum(batch["loss_mask"].sum(), 1.0)
    state, metrics = _applied(tx, state, grads, stats, count, total)
    return state, metrics, outputs


# ---- packed rows (learner/packing.py): a Python loop of micro-batches, their count following
# from the tokens (no recompilation when it changes), each micro-batch one [width, budget] shape.
def packing_inputs(cfg: UpdateConfig, batch: dict) -> dict:
    """What the packed update needs of a padded mini-batch before any gradient: the corrected
    `loss_mask` (and `is_weight`), each row's aggregation scale `row_scale` [N], the normaliser
    `count` and the token count `total_tokens` of the whole mini-batch."""
    batch = corrected(cfg, batch)
    mask = batch["loss_mask"]
    out = {"loss_mask": mask, "row_scale": AGGREGATIONS[cfg.loss.aggregation_name()].row_scale(mask > 0),
           "count": loss_count(cfg, mask), "total_tokens": jnp.maximum(mask.sum(), 1.0)}
    if "is_weight" in batch:
        out["is_weight"] = batch["is_weight"]
    return out


def packed_gradients(graphdef, cfg: UpdateConfig, params, accumulated, mb: dict, count, frozen=None, key=None):
    """(`accumulated` (None: zeros) plus one packed micro-batch's (gradient, statistic sums),
    its per-token outputs). mb: tokens, positions, segment_ids, loss_mask, advantages (per
    token), old_logprobs and token_scale [width, budget] (sampler_logprobs, ref_logprobs,
    is_weight when in use); a one-pass update sends neither old_logprobs nor token_scale (nor
    is_weight), and `count` 1 (`_loss_terms`)."""
    out, outputs = _micro_gradients(graphdef, cfg, params, mb, count, frozen, key)
    return (out if accumulated is None else jax.tree.map(jnp.add, accumulated, out)), outputs


def packed_apply(tx: optax.GradientTransformation, state: TrainState, accumulated, count, total_tokens):
    """The optimizer step on a packed mini-batch's accumulated gradients (count and total_tokens
    None: a one-pass update, which counted them in its micro-batches)."""
    grads, stats = accumulated
    if count is None:
        grads, stats, count, total_tokens = _one_pass_normalised(grads, stats)
    return _applied(tx, state, grads, stats, count, total_tokens)
