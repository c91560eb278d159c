"""KL to a frozen reference policy: the estimators and the settings (`rl.kl.*`).

Per token, with log r = log pi_ref(y_t) - log pi(y_t) (J. Schulman, "Approximating KL
divergence", 2020; verl `kl_penalty_forward`, verl/trainer/ppo/core_algos.py):

    k1 = -log r                 unbiased, can be negative
    k2 = (log r)^2 / 2          biased, low variance; its gradient is the true KL gradient
    k3 = r - 1 - log r          unbiased, always >= 0 ("low_var_kl"; GRPO's, DeepSeekMath eq. 4)

verl clamps log r to +-20 and k3 to +-10 for stability; so does this module.
Off by default (the paper trains without a reference).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from rstar2_jax.core.config_types import Section, setting
from rstar2_jax.core.registry import Registry
from rstar2_jax.algo.log_ratio import LOG_RATIO_BOUND

KL_ESTIMATORS: Registry = Registry("KL estimator")
KL_PLACES = ("loss", "reward")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs, ref_logprobs):
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs, ref_logprobs):
    return 0.5 * jnp.square(logprobs - ref_logprobs)


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs, ref_logprobs):
    log_r = jnp.clip(ref_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -10.0, 10.0)


@dataclasses.dataclass(frozen=True)
class KLConfig(Section):
    """`rl.kl.*`: a KL term to a frozen reference (the weights RL starts from: after SFT, if any)."""
    coef: float = setting(0.0, "weight of the KL term (0: off, the paper)", min=0.0)
    estimator: str = setting("k3", "per-token estimator: k1 | k2 | k3 (GRPO's)", choices=KL_ESTIMATORS)
    place: str = setting("loss", "loss: coef x KL per token added to the loss (verl use_kl_loss, GRPO); reward: "
                         "coef x the sequence's summed KL taken from its reward before the group advantage "
                         "(verl use_kl_in_reward)", choices=KL_PLACES)

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    @property
    def in_loss(self) -> bool:
        return self.enabled and self.place == "loss"

    @property
    def in_reward(self) -> bool:
        return self.enabled and self.place == "reward"


def sequence_kl(estimator: str, logprobs, ref_logprobs, mask) -> np.ndarray:
    """Each sequence's KL to the reference [N]: the estimator summed over its model tokens (what
    verl's KL-in-reward takes from the sequence's score under an outcome reward)."""
    per_token = np.asarray(KL_ESTIMATORS[estimator](jnp.asarray(logprobs), jnp.asarray(ref_logprobs)))
    return np.where(np.asarray(mask) > 0, per_token, 0.0).sum(axis=-1)
