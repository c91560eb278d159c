"""GRPO-RoC as pure functions: RoC selections, advantages, policy losses (registries of names)."""

from rstar2_jax.algo.advantages import ADVANTAGES, advantages, grpo_advantages
from rstar2_jax.algo.losses import LOSSES, PolicyLossConfig, clip_higher_loss, kl_penalty, loss_fn
from rstar2_jax.algo.roc import SELECTIONS, group_is_informative, roc_select

__all__ = ["ADVANTAGES", "LOSSES", "PolicyLossConfig", "SELECTIONS", "advantages", "clip_higher_loss", "grpo_advantages",
           "group_is_informative", "kl_penalty", "loss_fn", "roc_select"]
