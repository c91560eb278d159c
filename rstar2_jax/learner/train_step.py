"""The jitted GRPO-RoC update: a pure function of (state, batch).

Gradient accumulation over micro-batches is a `lax.scan` of gradients of each micro-batch's loss
*sum*, divided once by the token count of the whole batch, so M micro-batches give the same
update as one (token-level mean over the batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rstar2_jax.algo.losses import loss_fn, truncated_importance_weights
from rstar2_jax.models.logprobs import token_logprobs


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any          # nnx.State of the model's Params (float32 master weights)
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class LossConfig:
    name: str = "clip_higher"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    temperature: float = 1.0
    logprob_chunk: int = 512
    micro_batches: int = 1
    # Truncated importance sampling between the sampler's log-probs and the learner's recomputed
    # ones (None: off, the paper's setting; the batch then needs no sampler_logprobs).
    tis_cap: float | None = None


def compute_logprobs(graphdef, params, tokens, cfg: LossConfig, with_entropy: bool = False):
    """Log-probs of every token under `params` [N, T] (the learner's 'old' log-probs); with
    `with_entropy`, also the entropy of the distribution each token was drawn from [N, T]."""
    model = nnx.merge(graphdef, params)
    return token_logprobs(model, tokens, chunk_size=cfg.logprob_chunk, temperature=cfg.temperature,
                          with_entropy=with_entropy)


def batch_logprobs(graphdef, params, tokens, cfg: LossConfig, with_entropy: bool = False):
    """`compute_logprobs` of a whole batch, cfg.micro_batches rows-slices at a time (a `lax.map`),
    so the old-log-prob pass holds one micro-batch's activations, as the update does, never the
    whole batch's (a batch whose rows do not split evenly goes in one piece)."""
    n, m = tokens.shape[0], cfg.micro_batches
    if m == 1 or n % m:
        return compute_logprobs(graphdef, params, tokens, cfg, with_entropy)
    micro = tokens.reshape((m, n // m) + tokens.shape[1:])
    out = jax.lax.map(lambda t: compute_logprobs(graphdef, params, t, cfg, with_entropy), micro)
    return jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), out)


def _policy_loss(graphdef, cfg: LossConfig, params, batch):
    """(loss sum, token count, stats, log-probs) of the configured policy loss on `batch`."""
    lp = compute_logprobs(graphdef, params, batch["tokens"], cfg)
    mask = batch["loss_mask"]
    weights, stats = None, {}
    if cfg.tis_cap is not None:
        weights = jax.lax.stop_gradient(truncated_importance_weights(batch["old_logprobs"], batch["sampler_logprobs"],
                                                                     cfg.tis_cap))
        stats = {"tis_weight_sum": jnp.sum(weights * mask),
                 "tis_truncated_sum": jnp.sum((weights >= cfg.tis_cap).astype(jnp.float32) * mask)}
    loss_sum, count, loss_stats = loss_fn(cfg.name)(lp, batch["old_logprobs"], batch["advantages"], mask,
                                                    eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                                    dual_clip=cfg.dual_clip, token_weights=weights)
    return loss_sum, count, {**loss_stats, **stats}, lp


def train_step(graphdef, tx: optax.GradientTransformation, cfg: LossConfig, state: TrainState, batch: dict):
    """batch: tokens [N, T], loss_mask [N, T], advantages [N], old_logprobs [N, T] (and
    sampler_logprobs [N, T] with cfg.tis_cap)."""
    n = batch["tokens"].shape[0]
    m = cfg.micro_batches
    if n % m:
        raise ValueError(f"batch of {n} rows does not split into {m} micro-batches")
    micro = jax.tree.map(lambda x: x.reshape((m, n // m) + x.shape[1:]), batch)
    total_tokens = jnp.maximum(batch["loss_mask"].sum(), 1.0)

    def micro_loss(params, mb):
        loss_sum, _, stats, lp = _policy_loss(graphdef, cfg, params, mb)
        nll = -jnp.sum(lp * mb["loss_mask"])
        return loss_sum / total_tokens, (stats, nll)

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def accumulate(carry, mb):
        grads, stats_sum = carry
        g, (stats, nll) = grad_fn(state.params, mb)
        grads = jax.tree.map(jnp.add, grads, g)
        stats_sum = {k: stats_sum[k] + v for k, v in {**stats, "nll_sum": nll}.items()}
        return (grads, stats_sum), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    stats0 = {"clip_fraction_sum": 0.0, "approx_kl_sum": 0.0, "nll_sum": 0.0}
    if cfg.tis_cap is not None:
        stats0.update(tis_weight_sum=0.0, tis_truncated_sum=0.0)
    (grads, stats), _ = jax.lax.scan(accumulate, (zeros, jax.tree.map(jnp.float32, stats0)), micro)

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "grad_norm": optax.global_norm(grads),
        "update_norm": optax.global_norm(updates),
        "clip_fraction": stats["clip_fraction_sum"] / total_tokens,
        "approx_kl": stats["approx_kl_sum"] / total_tokens,
        "nll_per_token": stats["nll_sum"] / total_tokens,
        "tokens": total_tokens,
    }
    if cfg.tis_cap is not None:
        metrics["tis_weight_mean"] = stats["tis_weight_sum"] / total_tokens
        metrics["tis_truncated_fraction"] = stats["tis_truncated_sum"] / total_tokens
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def policy_loss_value(graphdef, cfg: LossConfig, params, batch) -> jax.Array:
    """The token-mean policy loss of a batch (no gradient): for tests and logging."""
    s, c, _, _ = _policy_loss(graphdef, cfg, params, batch)
    return s / jnp.maximum(c, 1.0)
