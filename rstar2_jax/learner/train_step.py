"""The jitted policy update: a pure function of (state, mini-batch).

The loss is the registered policy loss (algo/losses) on one `LossInputs`, weighted and masked
by the off-policy corrections in use (algo/corrections: computed once per mini-batch, before any
gradient, from the learner's and the sampler's log-probs), plus a KL term to a frozen reference,
then aggregated (algo/aggregation.py). Gradient accumulation over micro-batches is a `lax.scan` of gradients of
each micro-batch's *scaled sum*, divided once by the aggregation's count of the whole
mini-batch (computed from the mask before any gradient), so M micro-batches give the same
update as one, in every aggregation mode. Statistics are token means over the mini-batch.
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
from rstar2_jax.models.decoder import PackedSegments
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
                   micro_batches=settings.micro_batches, temperature=temperature, constant_tokens=float(c))

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
    """(scaled loss sum, {statistic: token sum}, log-probs) of one (micro-)batch: the policy
    loss, the corrections' weights (`is_weight`, when corrections are on) and the KL term, masked
    and scaled per row by the aggregation."""
    lp = compute_logprobs(graphdef, params, batch["tokens"], cfg, positions=batch.get("positions"),
                          segment_ids=packed_segments(batch), frozen=frozen)
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
    if "token_scale" in batch:  # packed rows: each token carries its row's scale, computed before packing
        loss_sum = jnp.sum(jnp.where(mask, per_token, 0.0) * batch["token_scale"])
    else:
        row_scale = AGGREGATIONS[cfg.loss.aggregation_name()].row_scale(mask)
        loss_sum = jnp.sum(jnp.sum(jnp.where(mask, per_token, 0.0), axis=-1) * row_scale)
    return loss_sum, {k: jnp.sum(v) for k, v in stats.items()}, lp


def corrected(cfg: UpdateConfig, batch: dict) -> dict:
    """`batch` with the off-policy corrections applied (unchanged when none): `is_weight` [N, T],
    and the tokens they drop taken out of `loss_mask`, so they leave the loss and its count."""
    if not cfg.correction.enabled:
        return batch
    c = combined_correction(cfg.correction.names, cfg.correction.settings_of,
                            CorrectionInputs(batch["old_logprobs"], batch["sampler_logprobs"], batch["loss_mask"] > 0))
    return {**batch, "loss_mask": c.keep.astype(batch["loss_mask"].dtype), "is_weight": c.weight}


def loss_count(cfg: UpdateConfig, mask) -> jax.Array:
    """The aggregation's normaliser of a whole (mini-)batch: depends on the mask alone."""
    return jnp.maximum(AGGREGATIONS[cfg.loss.aggregation_name()].count(mask > 0, cfg.constant_tokens), 1e-9)


def step_key(step, micro) -> jax.Array:
    """The PRNG key of optimizer step `step`'s micro-batch `micro`: LoRA dropout's (models/lora.py),
    so a resumed run drops what the uninterrupted one did."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), step), micro)


def _micro_gradients(graphdef, cfg: UpdateConfig, params, mb: dict, count, frozen=None, key=None):
    """(gradient, {statistic: sum}) of one micro-batch's scaled loss sum / `count` (the whole
    mini-batch's normaliser): summed over micro-batches, the mini-batch's gradient. key: LoRA
    dropout's (None: none)."""
    def micro_loss(p):
        with dropout_key(key):
            loss_sum, stats, _ = _loss_terms(graphdef, cfg, p, mb, frozen)
        return loss_sum / count, {**stats, "policy_loss": loss_sum}
    return jax.grad(micro_loss, has_aux=True)(params)


def _zeros_like_gradients(graphdef, cfg: UpdateConfig, params, mb: dict, frozen=None):
    """Zeros shaped as `_micro_gradients`' result: the gradient's like the parameters (their
    shardings too: the accumulator is split as they are), the statistics' from the loss and the
    options in use (nothing hard-coded here)."""
    stats = jax.eval_shape(lambda p, b: _micro_gradients(graphdef, cfg, p, b, 1.0, frozen), params, mb)[1]
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
    """One optimizer step on padded rows. batch: tokens [N, T], loss_mask [N, T], advantages [N],
    old_logprobs [N, T] (sampler_logprobs [N, T] with corrections, ref_logprobs [N, T] with a KL
    term); cfg.micro_batches row slices, accumulated in a `lax.scan`. frozen: the LoRA base (None: the
    state's params are the whole model)."""
    batch = corrected(cfg, batch)
    n = batch["tokens"].shape[0]
    m = cfg.micro_batches
    if n % m:
        raise ValueError(f"batch of {n} rows does not split into {m} micro-batches")
    micro = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), batch)
    count = loss_count(cfg, batch["loss_mask"])

    def accumulate(carry, xs):
        mb, i = xs
        out = _micro_gradients(graphdef, cfg, state.params, mb, count, frozen, step_key(state.step, i))
        return jax.tree.map(jnp.add, carry, out), None

    zeros = _zeros_like_gradients(graphdef, cfg, state.params, jax.tree.map(lambda x: x[0], micro), frozen)
    (grads, stats), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(m)))
    return _applied(tx, state, grads, stats, count, jnp.maximum(batch["loss_mask"].sum(), 1.0))


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
    """`accumulated` (None: zeros) plus one packed micro-batch's (gradient, statistic sums).
    mb: tokens, positions, segment_ids, loss_mask, advantages (per token), old_logprobs,
    token_scale [width, budget] (sampler_logprobs, ref_logprobs, is_weight when in use)."""
    out = _micro_gradients(graphdef, cfg, params, mb, count, frozen, key)
    return out if accumulated is None else jax.tree.map(jnp.add, accumulated, out)


def packed_apply(tx: optax.GradientTransformation, state: TrainState, accumulated, count, total_tokens):
    """The optimizer step on a packed mini-batch's accumulated gradients."""
    grads, stats = accumulated
    return _applied(tx, state, grads, stats, count, total_tokens)


def policy_loss_value(graphdef, cfg: UpdateConfig, params, batch, frozen=None) -> jax.Array:
    """The aggregated loss of a batch (no gradient): for tests and logging."""
    batch = corrected(cfg, batch)
    s, _, _ = _loss_terms(graphdef, cfg, params, batch, frozen)
    return s / loss_count(cfg, batch["loss_mask"])
