"""The algorithms as pure functions: RoC selections (their registry: rl/roc_modes/, the RoC
modes), advantages, policy losses (one module each under losses/), loss aggregations, KL
estimators."""

from rstar2_jax.algo.advantages import ADVANTAGES, advantages, grpo_advantages
from rstar2_jax.algo.aggregation import AGGREGATIONS, aggregate
from rstar2_jax.algo.kl import KL_ESTIMATORS, KLConfig
from rstar2_jax.algo.losses import LOSSES, LossInputs, LossTerms, PolicyLossConfig, policy_loss_terms, register_loss
from rstar2_jax.algo.roc import group_is_informative, roc_select

__all__ = ["ADVANTAGES", "AGGREGATIONS", "KLConfig", "KL_ESTIMATORS", "LOSSES", "LossInputs", "LossTerms",
           "PolicyLossConfig", "advantages", "aggregate", "grpo_advantages", "group_is_informative",
           "policy_loss_terms", "register_loss", "roc_select"]
