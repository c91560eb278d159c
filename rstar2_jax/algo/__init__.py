"""GRPO-RoC as pure functions: RoC selection, advantages, policy losses (registered by name)."""

from rstar2_jax.algo.advantages import ADVANTAGES, advantages, grpo_advantages
from rstar2_jax.algo.losses import LOSSES, clip_higher_loss, kl_penalty, loss_fn
from rstar2_jax.algo.roc import SELECTION_MODES, group_is_informative, roc_select

__all__ = ["ADVANTAGES", "LOSSES", "SELECTION_MODES", "advantages", "clip_higher_loss", "grpo_advantages",
           "group_is_informative", "kl_penalty", "loss_fn", "roc_select"]
