"""REINFORCE with the group advantage: -A log pi per token, no ratio, no clip.

GPG (Chu et al. 2025, arXiv 2504.02546, eq. 5); verl `compute_policy_loss_gpg`. With one update
per batch its gradient is the clip-higher loss's (every ratio is 1); with several optimizer
steps per batch nothing holds the policy near the one that sampled. Also the worked example of
docs/DESIGN.md, "Adding a part".
"""

from __future__ import annotations

import dataclasses

from rstar2_jax.algo.losses.base import LossInputs, LossTerms, register_loss
from rstar2_jax.core.config_types import Section


@dataclasses.dataclass(frozen=True)
class ReinforceSettings(Section):
    """`rl.loss.reinforce.*`: none (the loss has no constant of its own)."""


@register_loss("reinforce", settings=ReinforceSettings, stats=())
def reinforce_loss(inputs: LossInputs, s: ReinforceSettings) -> LossTerms:
    return LossTerms(-inputs.token_advantages * inputs.logprobs, {})
