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
from flax import nnx

from rstar2_jax.algo import (AGGREGATIONS, KL_ESTIMATORS, LOSSES, KLConfig, LossInputs, PolicyLossConfig,
                             policy_loss_terms)
from rstar2_jax.algo.corrections import CorrectionConfig, CorrectionInputs, combined_correction
from rstar2_jax.models.logprobs import token_logprobs


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any          # nnx.State of the model's Params (float32 master weights)
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """What the jitted update reads: the run's `rl.loss` and `rl.kl` sections as they are, and the
    learner-side settings of `rl.*` (rl/trainer.py builds it; tests build it directly)."""
    loss: PolicyLossConfig = dataclasses.field(default_factory=PolicyLossConfig)
    kl: KLConfig = KLConfig()
    temperature: float = 1.0
    logprob_chunk: int = 512
    micro_batches: int = 1
    # Off-policy corrections between the sampler's log-probs and the learner's recomputed ones
    # (none: the paper's setting; the batch then needs no sampler_logprobs).
    correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)
    # aggregation=constant: C (rl.loss.constant_tokens, resolved by the trainer when 0).
    constant_tokens: float = 1.0

    @property
    def needs_sampler_logprobs(self) -> bool:
        return self.correction.enabled or LOSSES[self.loss.name].needs_sampler_logprobs


def compute_logprobs(graphdef, params, tokens, cfg: UpdateConfig, with_entropy: bool = False):
    """Log-probs of every token under `params` [N, T] (the learner's 'old' log-probs); with
    `with_entropy`, also the entropy of the distribution each token was drawn from [N, T]."""
    model = nnx.merge(graphdef, params)
    return token_logprobs(model, tokens, chunk_size=cfg.logprob_chunk, temperature=cfg.temperature,
                          with_entropy=with_entropy)


def batch_logprobs(graphdef, params, tokens, cfg: UpdateConfig, with_entropy: bool = False):
    """`compute_logprobs` of a whole batch, cfg.micro_batches rows-slices at a time (a `lax.map`),
    so the old-log-prob pass holds one micro-batch's activations, as the update does, never the
    whole batch's (a batch whose rows do not split evenly goes in one piece)."""
    n, m = tokens.shape[0], cfg.micro_batches
    if m == 1 or n % m:
        return compute_logprobs(graphdef, params, tokens, cfg, with_entropy)
    micro = tokens.reshape((m, n // m) + tokens.shape[1:])
    out = jax.lax.map(lambda t: compute_logprobs(graphdef, params, t, cfg, with_entropy), micro)
    return jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), out)


def _loss_terms(graphdef, cfg: UpdateConfig, params, batch):
    """(scaled loss sum, {statistic: token sum}, log-probs) of one (micro-)batch: the policy
    loss, the corrections' weights (`is_weight`, when corrections are on) and the KL term, masked
    and scaled per row by the aggregation."""
    lp = compute_logprobs(graphdef, params, batch["tokens"], cfg)
    mask = batch["loss_mask"] > 0
    inputs = LossInputs(lp, batch["old_logprobs"], batch["advantages"], mask, batch.get("sampler_logprobs"),
                        batch.get("ref_logprobs"), log_ratio_clamp=cfg.loss.log_ratio_clamp).sanitized()
    terms = policy_loss_terms(cfg.loss.name, inputs, cfg.loss.settings())
    per_token, stats = terms.per_token, dict(terms.stats)
    if "is_weight" in batch:
        per_token = per_token * jax.lax.stop_gradient(batch["is_weight"])
    if cfg.kl.in_loss:
        kl = jnp.where(mask, KL_ESTIMATORS[cfg.kl.estimator](inputs.logprobs, inputs.ref_logprobs), 0.0)
        per_token = per_token + cfg.kl.coef * kl
        stats[f"kl_ref_{cfg.kl.estimator}"] = kl
    stats["nll_per_token"] = -inputs.logprobs
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


def train_step(graphdef, tx: optax.GradientTransformation, cfg: UpdateConfig, state: TrainState, batch: dict):
    """One optimizer step. batch: tokens [N, T], loss_mask [N, T], advantages [N], old_logprobs
    [N, T] (sampler_logprobs [N, T] with corrections, ref_logprobs [N, T] with a KL term)."""
    batch = corrected(cfg, batch)
    n = batch["tokens"].shape[0]
    m = cfg.micro_batches
    if n % m:
        raise ValueError(f"batch of {n} rows does not split into {m} micro-batches")
    micro = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), batch)
    count = loss_count(cfg, batch["loss_mask"])
    total_tokens = jnp.maximum(batch["loss_mask"].sum(), 1.0)

    def micro_loss(params, mb):
        loss_sum, stats, _ = _loss_terms(graphdef, cfg, params, mb)
        return loss_sum / count, {**stats, "policy_loss": loss_sum}

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def accumulate(carry, mb):
        grads, stats_sum = carry
        g, stats = grad_fn(state.params, mb)
        return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, stats_sum, stats)), None

    # The statistics' names come from the loss and the options in use (nothing hard-coded here).
    first = jax.tree.map(lambda x: x[0], micro)
    stats0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, state.params, first)[1])
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, stats), _ = jax.lax.scan(accumulate, (zeros, stats0), micro)

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {k: v / total_tokens for k, v in stats.items() if k != "policy_loss"}
    metrics.update(policy_loss=stats["policy_loss"] / count, grad_norm=optax.global_norm(grads),
                   update_norm=optax.global_norm(updates), tokens=total_tokens)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def policy_loss_value(graphdef, cfg: UpdateConfig, params, batch) -> jax.Array:
    """The aggregated loss of a batch (no gradient): for tests and logging."""
    batch = corrected(cfg, batch)
    s, _, _ = _loss_terms(graphdef, cfg, params, batch)
    return s / loss_count(cfg, batch["loss_mask"])
